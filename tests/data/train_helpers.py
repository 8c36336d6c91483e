"""Short in-process training runs on the tiny model, for the dataset-format tests.

    result, losses = train_tiny("dpo", tmp_path, model, {"kind": "jsonl_path", "path": str(path)}, steps=3)

Each run writes a TOML config (the dataset block as an inline table, so
mixtures and column maps need no table syntax), loads it with
`rollout.config.load_config` exactly as the CLI does, calls the algorithm's
train function and returns its per-step `train/loss` from the run's store.
Runs take about half a second once torch is imported.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def U(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def A(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def make_tiny_model(root: Path) -> Path:
    from rollout.models.tiny import init_tiny_model

    return init_tiny_model(root / "tiny")


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def toml_value(value: Any) -> str:
    """A TOML value; dicts become inline tables (keys quoted), lists arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[ " + ", ".join(toml_value(v) for v in value) + " ]"
    raise TypeError(f"no TOML for {value!r}")


def write_config(
    root: Path, kind: str, model: Path, dataset: dict[str, Any], *, steps: int = 3, minibatch: int = 4,
    **settings: Any,
) -> Path:
    """A tiny run config under `root` (its own store), returned as a path."""
    block = {
        "minibatch_size": minibatch,
        "base_model": {"uri": str(model)},
        "optimizer": {"kind": "adamw", "lr": 1e-3},
        "budget": {"max_steps": steps},
        "dataset": dataset,
        "packing": {"kind": "off", "max_seq_len": 64},
        **settings,
    }
    lines = [
        "schema_version = 1",
        "seed = 0",
        "[storage]",
        f"embedded = {{ path = {toml_value(root / 'store' / 'rollout.db')} }}",
        f"objects = {{ backend = \"fs\", path = {toml_value(root / 'store' / 'objects')} }}",
        "[algorithm]",
        f'kind = "{kind}"',
        f"[algorithm.{kind}]",
        *(f"{key} = {toml_value(value)}" for key, value in block.items()),
        "[backend]",
        'kind = "torch"',
        'device = "cpu"',
        "num_threads = 1",
    ]
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{kind}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_tiny(kind: str, root: Path, model: Path, dataset: dict[str, Any], **kwargs: Any) -> tuple[Any, list[float]]:
    """Train in-process; (TrainResult, train/loss per step)."""
    from rollout.config import load_config
    from rollout.store import open_store

    cfg = load_config(write_config(root, kind, model, dataset, **kwargs))
    train = getattr(importlib.import_module(f"rollout.algorithms.{kind}"), f"train_{kind}")
    result = train(cfg)
    store = open_store("embedded", path=root / "store" / "rollout.db")
    try:
        losses = [m.value for m in store.read_metrics(result.run_id, name="train/loss")]
    finally:
        store.close()
    return result, losses


def run_cli(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`rollout ARGS...` in a fresh interpreter, offline (plus `env`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", *map(str, args)], capture_output=True, text=True, env=env,
        timeout=120,
    )
