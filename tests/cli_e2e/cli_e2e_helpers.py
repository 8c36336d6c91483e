"""Helpers for the end-to-end CLI tests: run the installed `rollout` script, check its errors, write configs.

The fixtures in this folder's conftest.py build on these; test modules import
the plain functions directly (`from cli_e2e_helpers import run_cli`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLLOUT = Path(sys.executable).parent / "rollout"
DELETE = object()
"""An override value that removes the key from the default config."""


def cli_env() -> dict[str, str]:
    """The environment the CLI runs in: offline, no ROLLOUT_* defaults, HF progress bars as shipped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # the CLI itself must keep stderr clean
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_cli(
    *args: str | Path, cwd: Path | None = None, timeout: float = 180, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`rollout ARGS...` as a subprocess (`env`: variables added to `cli_env()`); stdout and stderr
    captured as text."""
    return subprocess.run(
        [str(ROLLOUT), *map(str, args)],
        cwd=cwd,
        env={**cli_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli_side_by_side(*commands: list[str | Path]) -> list[subprocess.CompletedProcess[str]]:
    """Several independent `rollout` commands at once (each is mostly torch import time, one core each)."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


def run_python(
    code: str, *, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -c CODE` with the test interpreter (the project's venv)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


def first_line(text: str) -> str:
    """Up to the first newline: what `head -1` of a captured stderr shows (a progress bar's \r frames included)."""
    return text.split("\n", 1)[0]


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    assert "Traceback" not in result.stderr, result.stderr


def assert_user_error(result: subprocess.CompletedProcess[str], expected: str, *, exact: bool = False) -> str:
    """Exit 2, no traceback, and stderr's first line is `error: ...` containing (or equal to) `expected`."""
    shown = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 2, shown
    assert "Traceback" not in result.stderr, shown
    line = first_line(result.stderr)
    assert line.startswith("error: "), f"stderr's first line is not the error:\n{shown}"
    if exact:
        assert line == f"error: {expected}", shown
    else:
        assert expected in line, shown
    return line


def list_runs(storage_db: Path) -> list[dict[str, Any]]:
    result = run_cli("runs", "list", "--json", "--storage-path", storage_db)
    assert_ok(result)
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- configs


def default_config(kind: str, *, model: Path, dataset: Path, storage_dir: Path) -> dict[str, Any]:
    """A tiny, fast run config (the shape of examples/<kind>-tiny.toml) with absolute paths."""
    return {
        "schema_version": 1,
        "seed": 0,
        "storage": {
            "backend": "embedded",
            "embedded": {"path": str(storage_dir / "rollout.db")},
            "objects": {"backend": "fs", "path": str(storage_dir / "objects")},
        },
        "algorithm": {
            "kind": kind,
            kind: {
                "minibatch_size": 4,
                "gradient_accumulation": 1,
                "base_model": {"uri": str(model), "dtype": "float32"},
                "optimizer": {"kind": "adamw", "lr": 1e-3},
                "budget": {"max_steps": 4},
                "dataset": {"kind": "jsonl_path", "path": str(dataset)},
                "packing": {"kind": "off", "max_seq_len": 64},
                "loss_on": {"kind": "assistant" if kind == "sft" else "full"},
                "snapshot": {"every_steps": 2, "keep_last": 3},
            },
        },
        "backend": {"kind": "torch", "device": "cpu", "num_threads": 1},  # others share the cores
        "distributed": {"kind": "local"},
    }


def merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` with nested `overrides` applied (`DELETE` removes a key)."""
    out = dict(base)
    for key, value in overrides.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def dump_toml(data: Mapping[str, Any]) -> str:
    """TOML for nested tables of scalars (all our configs need)."""
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines) + "\n"


def _dump_table(table: Mapping[str, Any], prefix: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if prefix and (scalars or not tables):
        lines.append(f"[{'.'.join(prefix)}]")
    for key, value in scalars.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables.items():
        _dump_table(value, [*prefix, key], lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a TOML basic string for our (ASCII) paths and names
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


# --------------------------------------------------------------------------- trained runs


@dataclass(frozen=True)
class TrainedRun:
    """What a finished `rollout train` left behind."""

    config: Path
    storage_db: Path
    objects: Path
    run_id: str
    final_snapshot_id: str
    events_dir: Path
    export_dir: Path | None
    stdout: str
    stderr: str

    def storage_flags(self) -> list[str]:
        return ["--storage-path", str(self.storage_db), "--object-path", str(self.objects)]


def parse_train_stdout(stdout: str) -> dict[str, str]:
    """run id, final snapshot id and the events folder from `rollout train`'s summary lines."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        words = line.split()
        if line.startswith("run ") and " succeeded after " in line:
            found["run_id"] = words[1]
        elif line.startswith("final snapshot "):
            found["final_snapshot_id"] = words[2]
        elif line.startswith("store ") and " events " in line:
            found["events_dir"] = line.rsplit(" events ", 1)[1]
        elif line.startswith("exported model "):
            found["export_dir"] = line.removeprefix("exported model ")
    return found


def blob_path(objects: Path, digest: str) -> Path:
    """Where the fs object store keeps a blob: root/ab/cd/<digest> (SPEC section 5)."""
    return objects / digest[:2] / digest[2:4] / digest
