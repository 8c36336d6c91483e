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
