"""Session fixtures: the tiny model and the arithmetic data, made once; the models several learning
tests start from (the SFT example, the warm-up SFT, the reward-centred RM), trained once per test
session and shared by the xdist workers (the first worker to ask trains, the others wait for it)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from integration_helpers import example_config


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A folder shaped like the demo's `local/`: models/tiny and data/arithmetic."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("local")
    init_tiny_model(root / "models" / "tiny")
    write_arithmetic_dataset(root / "data" / "arithmetic")
    return root


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory, request) -> Path:
    """A folder every xdist worker of this test session sees (the workers' base temp's parent)."""
    base = tmp_path_factory.getbasetemp()
    under_xdist = hasattr(request.config, "workerinput")
    return (base.parent if under_xdist else base) / "shared-models"


def built_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`root/name`, made by `build(folder)` the first time any worker of the session asks for it.
    Training is seeded and deterministic, so whichever worker builds it, the result is the same."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    out = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)  # a build interrupted by a failure
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


def _train_example(name: str, workspace: Path, dest: Path, replace: dict[str, str] | None = None) -> None:
    from rollout.algorithms.registry import BUILTIN_ALGORITHMS
    from rollout.config import load_config

    cfg = load_config(example_config(name, workspace, dest, replace))
    result = BUILTIN_ALGORITHMS[cfg.algorithm.kind].load_train()(cfg)
    (dest / "result.json").write_text(json.dumps(dataclasses.asdict(result)))


def _trained(dest: Path, name: str) -> tuple:
    from rollout.algorithms.registry import TrainResult
    from rollout.config import load_config

    return load_config(dest / name), TrainResult(**json.loads((dest / "result.json").read_text()))


@pytest.fixture(scope="session")
def sft_run(workspace, shared_root):
    """(config, result) of the SFT example, trained once per session (its export starts the RM,
    DPO/KTO and the calculator task's no-tool baseline)."""
    dest = built_once(shared_root, "sft-run", lambda d: _train_example("sft-tiny.toml", workspace, d))
    return _trained(dest, "sft-tiny.toml")


@pytest.fixture(scope="session")
def rm_run(workspace, sft_run, shared_root):
    """(config, result) of the RM example (reward-centred) from the SFT example's export, trained
    once per session: the RM learning test checks it, the PPO-with-RM pipeline trains against it."""
    sft_export = sft_run[0].algorithm.settings.export.dir
    dest = built_once(shared_root, "rm-run", lambda d: _train_example(
        "rm-tiny.toml", workspace, d, {'"../local/models/sft-tiny"': f'"{sft_export}"'}))
    return _trained(dest, "rm-tiny.toml")


@pytest.fixture(scope="session")
def sft_warmup(workspace, shared_root) -> Path:
    """The warm-up SFT example's export (partly trained: where the GRPO, PPO and PPO-with-RM
    examples start), trained once per session."""
    dest = built_once(shared_root, "sft-warmup", lambda d: _train_example(
        "sft-warmup.toml", workspace, d, {'"../local/models/sft-warmup"': f'"{d}/model"'}))
    return dest / "model"
