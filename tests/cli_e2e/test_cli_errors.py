"""Bad input never gives a traceback: exit 2 and one clear `error: ...` line first (SPEC sections 1, 2, 4, 5).

HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e/test_cli_errors.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from cli_e2e_helpers import (
    DELETE,
    assert_ok,
    assert_user_error,
    blob_path,
    list_runs,
    run_cli,
    run_cli_side_by_side,
    run_python,
)

CHECKS = {  # the commands that must find config and dataset errors before any training
    "validate": ["validate"],
    "dry-run": ["train", "sft", "--dry-run"],
    "train": ["train", "sft"],
}
LIGHT_CHECKS = {k: v for k, v in CHECKS.items() if k != "train"}


def line_of(path: Path, startswith: str) -> int:
    """1-based number of the first line of `path` that starts with `startswith`."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith(startswith):
            return number
    raise AssertionError(f"{startswith!r} not in {path}")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def assert_no_runs(storage_db: Path) -> None:
    """Nothing trained: either no store was made at all or it holds no run."""
    if storage_db.exists():
        assert list_runs(storage_db) == []


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("command", CHECKS.values(), ids=CHECKS.keys())
def test_unknown_key_is_located(command, tmp_path, write_config):
    config = write_config(
        tmp_path / "run.toml", overrides={"algorithm": {"sft": {"optimizer": {"lrr": 1e-3}}}}
    )
    result = run_cli(*command, "--config", config)
    line = line_of(config, "lrr = ")
    assert_user_error(result, f"{config}:{line}: algorithm.sft.optimizer.lrr: unknown field", exact=True)
    assert_no_runs(tmp_path / "store" / "rollout.db")


def test_misspelt_key_reports_both_sides(tmp_path, write_config):
    """`lrr` instead of `lr`: the missing `lr` and the unknown `lrr` are both named."""
    overrides = {"algorithm": {"sft": {"optimizer": {"lr": DELETE, "lrr": 1e-3}}}}
    config = write_config(tmp_path / "run.toml", overrides=overrides)
    result = run_cli("validate", "--config", config)
    assert_user_error(result, "algorithm.sft.optimizer.lr")
    assert "algorithm.sft.optimizer.lrr: unknown field" in result.stderr
    assert "algorithm.sft.optimizer.lr: missing field" in result.stderr


@pytest.mark.parametrize("command", LIGHT_CHECKS.values(), ids=LIGHT_CHECKS.keys())
def test_wrong_type(command, tmp_path, write_config):
    config = write_config(tmp_path / "run.toml", overrides={"algorithm": {"sft": {"minibatch_size": "x"}}})
    result = run_cli(*command, "--config", config)
    line = assert_user_error(
        result, f"{config}:{line_of(config, 'minibatch_size = ')}: algorithm.sft.minibatch_size: "
    )
    assert "integer" in line


@pytest.mark.parametrize("lr", [0, -1])
@pytest.mark.parametrize("command", CHECKS.values(), ids=CHECKS.keys())
def test_learning_rate_must_be_positive(command, lr, tmp_path, write_config):
    config = write_config(tmp_path / "run.toml", overrides={"algorithm": {"sft": {"optimizer": {"lr": lr}}}})
    result = run_cli(*command, "--config", config)
    expected = f"{config}:{line_of(config, 'lr = ')}: algorithm.sft.optimizer.lr: must be greater than 0"
    assert_user_error(result, expected)
    assert_no_runs(tmp_path / "store" / "rollout.db")


@pytest.mark.parametrize("command", LIGHT_CHECKS.values(), ids=LIGHT_CHECKS.keys())
def test_missing_config_file(command, tmp_path):
    missing = tmp_path / "nope.toml"
    assert_user_error(run_cli(*command, "--config", missing), f"config not found: {missing}", exact=True)


def test_invalid_toml_names_file_and_line(tmp_path, write_config):
    config = write_config(tmp_path / "run.toml")
    text = config.read_text().splitlines()
    text[1] = "seed = = 0"  # line 2
    write_lines(config, text)
    line = assert_user_error(run_cli("validate", "--config", config), f"{config}: invalid TOML: ")
    assert "line 2" in line


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_algorithm_kind_must_match_subcommand(dry_run, tmp_path, write_config):
    config = write_config(tmp_path / "sft.toml", "sft")
    result = run_cli("train", "rm", "--config", config, *(["--dry-run"] if dry_run else []))
    assert_user_error(result, f"{config}: algorithm.kind is 'sft' but this is `rollout train rm`", exact=True)
    assert_no_runs(tmp_path / "store" / "rollout.db")


@pytest.mark.parametrize("command", CHECKS.values(), ids=CHECKS.keys())
def test_unimplemented_backend_kind_is_refused_before_training(command, tmp_path, write_config):
    """`backend.kind = "mock"` is valid config but no algorithm trains on it: refused at plan time, located."""
    config = write_config(tmp_path / "run.toml", overrides={"backend": {"kind": "mock"}})
    result = run_cli(*command, "--config", config)
    line = line_of(config, 'kind = "mock"')
    expected = f'{config}:{line}: backend.kind: "mock" is not implemented for sft (use "torch" or "fsdp")'
    assert_user_error(result, expected, exact=True)
    assert_no_runs(tmp_path / "store" / "rollout.db")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unknown_log_level(how, tmp_path, write_config):
    config = write_config(tmp_path / "run.toml")
    if how == "flag":
        result = run_cli("--log-level", "loud", "validate", "--config", config)
        expected = "--log-level: 'loud' is not a log level (use debug, info, warning, error)"
    else:
        result = run_cli("validate", "--config", config, env={"ROLLOUT_LOG": "Loud"})
        expected = "ROLLOUT_LOG: 'Loud' is not a log level (use debug, info, warning, error)"
    assert_user_error(result, expected, exact=True)
    assert_ok(run_cli("validate", "--config", config, env={"ROLLOUT_LOG": "WARNING"}))  # any case


def test_a_bug_says_so_on_the_first_line_and_the_traceback_follows():
    """An exception that is not a user error (a bug): exit 1, the first stderr line says it is a
    bug, what failed and where to report it; the traceback comes after."""
    code = (
        "import sys\n"
        "import rollout.cli.config_cmds as commands\n"
        "def validate() -> None:\n"
        "    raise RuntimeError('the widget broke\\nat the second line')\n"
        "commands.validate = validate\n"
        "from rollout.cli.main import main\n"
        "sys.exit(main(['validate']))\n"
    )
    result = run_python(code)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(
        "error: this is a bug in rollout (RuntimeError: the widget broke); please report it with the"
        " traceback below (rollout "
    ), result.stderr
    assert lines[1] == "Traceback (most recent call last):", result.stderr
    assert lines[-2:] == ["RuntimeError: the widget broke", "at the second line"], result.stderr


# --------------------------------------------------------------------------- data


@pytest.mark.parametrize("command", CHECKS.values(), ids=CHECKS.keys())
def test_missing_dataset(command, tmp_path, write_config):
    missing = tmp_path / "data" / "missing.jsonl"
    config = write_config(tmp_path / "run.toml", dataset=missing)
    line = line_of(config, f'path = "{missing}"')
    expected = f"{config}:{line}: algorithm.sft.dataset.path: dataset not found: {missing}"
    assert_user_error(run_cli(*command, "--config", config), expected, exact=True)
    assert_no_runs(tmp_path / "store" / "rollout.db")


@pytest.mark.parametrize("command", [["validate"], ["train", "rm"]], ids=["validate", "train"])
def test_preference_line_missing_a_field(command, tmp_path, write_config, arith_data):
    lines = arith_data["pref"].read_text().splitlines()[:6]
    third = json.loads(lines[2])
    del third["rejected"]
    lines[2] = json.dumps(third)
    bad = write_lines(tmp_path / "pref.jsonl", lines)
    config = write_config(tmp_path / "rm.toml", "rm", dataset=bad)
    result = run_cli(*command, "--config", config)
    assert_user_error(result, f'{bad}:3: missing field "rejected"', exact=True)
    assert_no_runs(tmp_path / "store" / "rollout.db")


@pytest.mark.parametrize("command", [["validate"], ["train", "sft"]], ids=["validate", "train"])
def test_invalid_json_line(command, tmp_path, write_config, arith_data):
    lines = arith_data["sft"].read_text().splitlines()[:8]
    lines[4] = '{"messages": [oops'
    bad = write_lines(tmp_path / "sft.jsonl", lines)
    config = write_config(tmp_path / "run.toml", dataset=bad)
    assert_user_error(run_cli(*command, "--config", config), f"{bad}:5: invalid JSON")
    assert_no_runs(tmp_path / "store" / "rollout.db")


# --------------------------------------------------------------------------- model


def test_missing_model_dir(tmp_path, write_config):
    missing = tmp_path / "models" / "nowhere"
    config = write_config(
        tmp_path / "run.toml", overrides={"algorithm": {"sft": {"base_model": {"uri": str(missing)}}}}
    )
    line = assert_user_error(run_cli("train", "sft", "--config", config), str(missing))
    assert "model" in line or "tokenizer" in line


# --------------------------------------------------------------------------- snapshots


@pytest.fixture
def sft_db_copy(tmp_path, sft_run) -> Path:
    """A copy of the SFT run's SQLite store (no blobs) in `tmp_path/store/`."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    for db_file in sft_run.storage_db.parent.glob("rollout.db*"):  # the SQLite file (+ WAL, if any)
        shutil.copy2(db_file, store_dir / db_file.name)
    return store_dir / "rollout.db"


def test_resume_from_unknown_snapshot_leaves_no_run(tmp_path, write_config, sft_db_copy):
    before = list_runs(sft_db_copy)
    assert before, "the copied store should hold the SFT run"
    config = write_config(tmp_path / "run.toml", storage_dir=sft_db_copy.parent)
    result = run_cli("train", "sft", "--config", config, "--resume", "deadbeefdeadbeef")
    assert_user_error(result, "snapshot not found: deadbeefdeadbeef", exact=True)
    assert list_runs(sft_db_copy) == before


def test_resume_from_another_algorithms_snapshot(tmp_path, write_config, sft_run, sft_db_copy):
    before = list_runs(sft_db_copy)
    config = write_config(tmp_path / "rm.toml", "rm", storage_dir=sft_db_copy.parent)
    result = run_cli("train", "rm", "--config", config, "--resume", sft_run.final_snapshot_id[:16])
    expected = f"snapshot {sft_run.final_snapshot_id[:12]} was saved by sft, cannot resume rm from it"
    assert_user_error(result, expected, exact=True)
    assert list_runs(sft_db_copy) == before


def test_unknown_run_id(sft_run):
    unknown = "01ARZ3NDEKTSV4RRFFQ69G5FAV"
    for command in (["runs", "show", unknown], ["logs", "tail", unknown]):
        result = run_cli(*command, "--storage-path", sft_run.storage_db)
        assert_user_error(result, f"run not found: {unknown}", exact=True)


def test_store_commands_need_an_existing_store(tmp_path):
    missing = tmp_path / "nowhere.db"
    for command in (["runs", "list"], ["snapshot", "list"], ["snapshot", "show", "deadbeefdeadbeef"]):
        result = run_cli(*command, "--storage-path", missing)
        assert_user_error(result, f"no store at {missing}", exact=True)
    assert not missing.exists()  # never created by a read command


def test_snapshot_show_unknown_and_too_short(sft_run):
    flags = sft_run.storage_flags()
    result = run_cli("snapshot", "show", "deadbeefdeadbeef", *flags)
    assert_user_error(result, "snapshot not found: deadbeefdeadbeef", exact=True)
    short = sft_run.final_snapshot_id[:4]  # a real id's prefix, but under the 8 characters SPEC asks for
    assert_user_error(run_cli("snapshot", "show", short, *flags), f"snapshot not found: {short}")


@pytest.fixture(scope="module")
def corrupted_store(tmp_path_factory, sft_run) -> Path:
    """A copy of the SFT run's store whose final snapshot has one byte of its model blob flipped."""
    store_dir = shutil.copytree(sft_run.storage_db.parent, tmp_path_factory.mktemp("corrupted") / "store")
    shown = run_cli("snapshot", "show", sft_run.final_snapshot_id, "--storage-path", store_dir / "rollout.db")
    assert_ok(shown)
    digest = json.loads(shown.stdout)["manifest"]["blobs"]["model"]["digest"]
    blob = blob_path(store_dir / "objects", digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return store_dir


@pytest.fixture(scope="module")
def corrupted_use(corrupted_store, write_config, sft_run) -> dict[str, Any]:
    """`train sft --resume` and `snapshot export` of the corrupted snapshot, run side by side."""
    db = corrupted_store / "rollout.db"
    runs_before = list_runs(db)
    config = write_config(corrupted_store.parent / "resume.toml", storage_dir=corrupted_store)
    out = corrupted_store.parent / "exported"
    resume, export = run_cli_side_by_side(
        ["train", "sft", "--config", config, "--resume", sft_run.final_snapshot_id],
        [
            "snapshot",
            "export",
            sft_run.final_snapshot_id,
            out,
            "--storage-path",
            db,
            "--object-path",
            corrupted_store / "objects",
        ],
    )
    return {"resume": resume, "export": export, "out": out, "runs_before": runs_before, "db": db}


def test_resume_from_corrupted_blob_is_refused(corrupted_use):
    assert_user_error(corrupted_use["resume"], "corrupted")
    known = {run["id"] for run in corrupted_use["runs_before"]}
    new_runs = [run for run in list_runs(corrupted_use["db"]) if run["id"] not in known]
    assert all(run["status"] == "failed" for run in new_runs), new_runs  # never left "running"


def test_export_of_corrupted_blob_is_refused(corrupted_use):
    assert_user_error(corrupted_use["export"], "corrupted")
    assert not (corrupted_use["out"] / "config.json").exists()


def test_prune_needs_run_id(sft_run):
    result = run_cli("snapshot", "prune", *sft_run.storage_flags())
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Missing option '--run-id'" in result.stderr
