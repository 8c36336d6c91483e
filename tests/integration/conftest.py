"""Session fixtures: the tiny model and the arithmetic data, made once."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A folder shaped like the demo's `local/`: models/tiny and data/arithmetic."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("local")
    init_tiny_model(root / "models" / "tiny")
    write_arithmetic_dataset(root / "data" / "arithmetic")
    return root


def example_config(name: str, workspace: Path, dest: Path, replace: dict[str, str] | None = None) -> Path:
    """The example config with `../local/` pointing at `workspace` and its store in `dest`."""
    text = (ROOT / "examples" / name).read_text()
    for old, new in (replace or {}).items():
        assert old in text, f"{old!r} not in {name}"
        text = text.replace(old, new)
    text = text.replace('"../local/rollout.db"', f'"{dest}/rollout.db"')
    text = text.replace('"../local/object-store"', f'"{dest}/object-store"')
    text = text.replace('"../local/models/sft-tiny"', f'"{dest}/sft-export"')
    text = text.replace('"../local/models/rm-tiny"', f'"{dest}/rm-export"')
    text = text.replace('"../local/models/dpo-tiny"', f'"{dest}/dpo-export"')
    text = text.replace('"../local/models/kto-tiny"', f'"{dest}/kto-export"')
    text = text.replace('"../local/models/grpo-tiny"', f'"{dest}/grpo-export"')
    text = text.replace('"../local/models/ppo-tiny"', f'"{dest}/ppo-export"')
    text = text.replace('"../local/', f'"{workspace}/')
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / name
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def sft_run(workspace, tmp_path_factory):
    """The SFT example trained once (its export starts DPO/KTO)."""
    from rollout.algorithms.sft import train_sft
    from rollout.config import load_config

    cfg = load_config(example_config("sft-tiny.toml", workspace, tmp_path_factory.mktemp("sft-run")))
    return cfg, train_sft(cfg)
