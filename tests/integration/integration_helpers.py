"""Helpers the integration tests import (`from integration_helpers import example_config`): a module of
its own, not `conftest`, because several test directories have a `conftest.py` and only one of them can
be the module named `conftest` in a pytest process."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def eval_metrics(capsys, env: str, model_dir: Path, data: Path, store_path: Path, *extra: str) -> dict[str, float]:
    """`rollout eval --env ENV` of a model folder on `data` (1 thread, `--json`): its metrics."""
    from rollout.cli.main import main

    args = ["eval", "--env", env, "--data", str(data), "--model", str(model_dir), "--json",
            "--storage-path", str(store_path), "--threads", "1", *extra]  # fmt: skip
    capsys.readouterr()
    try:
        main(args)
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["metrics"]


def held_out_rewards(model_dir: Path, rows: list[dict], *, seed: int = 123) -> tuple[float, float]:
    """Arithmetic held-out figures of a model folder: greedy accuracy, and the mean reward of 8 samples
    (temperature 1, 6 tokens) a prompt. Prompt i samples with seed `derive_seed(seed, i)`, as `rollout
    eval` seeds its rows: one seed for every prompt would give prompt after prompt the same random
    numbers, and the mean would then rest on 8 draws, not 8 x len(rows)."""
    from rollout.inference.hf_engine import load_hf_engine
    from rollout.inference.types import GenerationRequest, SamplingParams, derive_seed
    from rollout.tasks.arithmetic import is_correct

    engine = load_hf_engine(str(model_dir))
    greedy = engine.generate([GenerationRequest(prompt=r["prompt"]) for r in rows],
                             SamplingParams(temperature=0, max_tokens=6))  # fmt: skip
    sampled = engine.generate([
        GenerationRequest(prompt=r["prompt"],
                          params=SamplingParams(temperature=1.0, max_tokens=6, n=8, seed=derive_seed(seed, i)))
        for i, r in enumerate(rows)])  # fmt: skip
    accuracy = sum(is_correct(c[0].text, r["answer"]) for c, r in zip(greedy, rows, strict=True)) / len(rows)
    hits = sum(is_correct(x.text, r["answer"]) for c, r in zip(sampled, rows, strict=True) for x in c)
    return accuracy, hits / (8 * len(rows))
