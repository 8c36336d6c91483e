"""Session fixtures for the end-to-end CLI tests: one tiny model, one arithmetic data set, two short runs.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e -q

The model and data are made in-process (faster than `rollout model init-tiny`
and `rollout data arithmetic`); everything else goes through the installed
`rollout` script, exactly as a user would run it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from cli_e2e_helpers import (
    ROLLOUT,
    TrainedRun,
    assert_ok,
    cli_env,
    default_config,
    dump_toml,
    merge,
    parse_train_stdout,
)

WriteConfig = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sft/pref/prompts (+ eval_) JSONL files; 64 train lines are plenty for 4 steps of 4."""
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    written = write_arithmetic_dataset(
        tmp_path_factory.mktemp("data") / "arithmetic", num_train=64, num_eval=8
    )
    return {name: path.resolve() for name, path in written.items()}


@pytest.fixture(scope="session")
def write_config(tiny_model: Path, arith_data: dict[str, Path]) -> WriteConfig:
    """write_config(path, kind="sft", *, storage_dir=None, dataset=None, overrides=None) -> path.

    Storage defaults to `store/` beside the config; the dataset to the
    arithmetic sft.jsonl (sft) or pref.jsonl (rm). `overrides` is a nested
    dict merged into the default config (`cli_e2e_helpers.DELETE` drops a key).
    """

    def write(
        path: Path,
        kind: str = "sft",
        *,
        storage_dir: Path | None = None,
        dataset: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Path:
        path = Path(path)
        data = default_config(
            kind,
            model=tiny_model,
            dataset=dataset or arith_data["sft" if kind == "sft" else "pref"],
            storage_dir=storage_dir or path.parent / "store",
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_toml(merge(data, overrides or {})), encoding="utf-8")
        return path

    return write


def _start_training(
    kind: str, root: Path, write_config: WriteConfig, overrides: Mapping[str, Any], flags: tuple[str, ...] = ()
) -> tuple[Path, subprocess.Popen[bytes]]:
    """Start `rollout [FLAGS] train KIND` on a fresh store under `root` (output goes to files there)."""
    export_dir = root / "exported"
    config = write_config(
        root / f"{kind}.toml",
        kind,
        overrides={"algorithm": {kind: {**overrides, "export": {"dir": str(export_dir)}}}},
    )
    with (root / "stdout.txt").open("wb") as out, (root / "stderr.txt").open("wb") as err:
        process = subprocess.Popen(
            [str(ROLLOUT), *flags, "train", kind, "--config", str(config)], stdout=out, stderr=err, env=cli_env()
        )
    return config, process


def _finish_training(config: Path, process: subprocess.Popen[bytes]) -> TrainedRun:
    returncode = process.wait(timeout=300)
    root = config.parent
    result = subprocess.CompletedProcess(
        process.args, returncode, (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text()
    )
    assert_ok(result)
    found = parse_train_stdout(result.stdout)
    assert {"run_id", "final_snapshot_id", "events_dir", "export_dir"} <= set(found), result.stdout
    return TrainedRun(
        config=config,
        storage_db=root / "store" / "rollout.db",
        objects=root / "store" / "objects",
        run_id=found["run_id"],
        final_snapshot_id=found["final_snapshot_id"],
        events_dir=Path(found["events_dir"]),
        export_dir=Path(found["export_dir"]),
        stdout=result.stdout,
        stderr=result.stderr,
    )


@pytest.fixture(scope="session")
def trained_runs(
    tmp_path_factory: pytest.TempPathFactory, write_config: WriteConfig
) -> dict[str, TrainedRun]:
    """Two short runs, trained side by side (each is mostly import time, one core each).

    sft: 4 steps with snapshots at steps 2 and 4; rm: 2 steps with a snapshot
    every step, started as `rollout --log-level warning train rm` (no progress lines). Both have an
    `[export]` block. Tests that change a run's store
    (prune, corrupt a blob) must work on a copy or keep to changes the others
    don't see (`snapshot prune --keep-last 1` keeps the final snapshot).
    """
    plans = {
        "sft": {"budget": {"max_steps": 4}, "snapshot": {"every_steps": 2, "keep_last": 3}},
        "rm": {"budget": {"max_steps": 2}, "snapshot": {"every_steps": 1, "keep_last": 3}},
    }
    flags = {"sft": (), "rm": ("--log-level", "warning")}
    started = {
        kind: _start_training(kind, tmp_path_factory.mktemp(f"{kind}_run"), write_config, overrides, flags[kind])
        for kind, overrides in plans.items()
    }
    return {kind: _finish_training(*job) for kind, job in started.items()}


@pytest.fixture(scope="session")
def sft_run(trained_runs: dict[str, TrainedRun]) -> TrainedRun:
    return trained_runs["sft"]


@pytest.fixture(scope="session")
def rm_run(trained_runs: dict[str, TrainedRun]) -> TrainedRun:
    return trained_runs["rm"]
