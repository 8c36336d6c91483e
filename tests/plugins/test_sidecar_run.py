"""A real GRPO run whose reward comes from a sidecar that crashes mid-run: the round it was
scoring is dropped and counted, the sidecar restarts, the run finishes, and no process is left.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/plugins/test_sidecar_run.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollout.config import load_config
from rollout.store import open_store

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = Path(__file__).resolve().parent / "sidecars" / "reward.py"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("local")
    init_tiny_model(root / "models" / "tiny")
    write_arithmetic_dataset(root / "data" / "arithmetic")
    return root


def grpo_config(workspace: Path, dest: Path) -> Path:
    """examples/grpo-tiny.toml, shrunk to 2 steps on the untrained tiny model, with a second
    reward served by `reward.py crash_after 1` (it crashes on its second batch)."""
    command = json.dumps([sys.executable, str(SIDECAR), "crash_after", "1"])
    replace = {
        '"../local/models/sft-warmup"': f'"{workspace}/models/tiny"',
        "minibatch_size = 16": "minibatch_size = 3",
        "num_generations = 8": "num_generations = 4",
        "max_tokens = 6": "max_tokens = 4",
        "max_steps = 250": "max_steps = 2",
        "every_steps = 50": "every_steps = 2",
        "dynamic_sampling = true": "dynamic_sampling = false",
        "[algorithm.grpo.base_model]": (
            f'[[algorithm.grpo.rewards]]\nkind = "sidecar"\nname = "py_len"\ncommand = {command}\n'
            "timeout_s = 20\nweight = 0.1\n[algorithm.grpo.base_model]"
        ),
        '"../local/models/grpo-tiny"': f'"{dest}/export"',
        '"../local/': f'"{workspace}/',
    }
    text = (ROOT / "examples" / "grpo-tiny.toml").read_text()
    for old, new in replace.items():
        assert old in text, f"{old!r} not in grpo-tiny.toml"
        text = text.replace(old, new)
    text = text.replace(f'"{workspace}/rollout.db"', f'"{dest}/rollout.db"')
    text = text.replace(f'"{workspace}/object-store"', f'"{dest}/object-store"')
    path = dest / "grpo-sidecar.toml"
    path.write_text(text)
    return path


def test_grpo_with_a_crashing_sidecar_reward_finishes(workspace, tmp_path):
    from rollout.algorithms.grpo import train_grpo

    cfg = load_config(grpo_config(workspace, tmp_path))
    result = train_grpo(cfg)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    dropped = [e.fields for e in store.read_events(result.run_id) if e.name == "samples_dropped"]
    losses = [m.step for m in store.read_metrics(result.run_id, name="train/loss")]
    lengths = [m.value for m in store.read_metrics(result.run_id, name="rollout/reward/py_len")]
    store.close()
    assert result.steps == 2 and losses == [1, 2]
    assert len(lengths) == 2 and all(v > 0 for v in lengths)  # the sidecar scored both steps' batches
    assert [d["count"] for d in dropped] == [12]  # the one round (3 prompts x 4) it crashed on
    (reason,) = dropped[0]["reasons"]
    assert f'raised SidecarError: sidecar "{sys.executable} {SIDECAR} crash_after 1": exited with code 3' in reason
    assert "restarting it (1 of 3 restarts in a row)" in reason
