"""`--help`, `schema`, `validate` and `train --dry-run` work where torch can't be imported (SPEC section 2).

Setting `sys.modules["torch"] = None` makes every `import torch` raise
ImportError, as on a machine without the `torch` extra.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e/test_cli_no_torch.py -q
"""

from __future__ import annotations

import json

import pytest
from cli_e2e_helpers import assert_ok, assert_user_error, run_python

HEAVY = ("torch", "transformers", "safetensors")


def run_without_torch(*args: object):
    """`rollout ARGS...` in a fresh interpreter where torch, transformers and safetensors can't be imported."""
    argv = json.dumps(["rollout", *map(str, args)])
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in HEAVY)
    code = f"import sys; {blocked}; sys.argv = {argv}; from rollout.cli.main import main; main()"
    return run_python(code)


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_dry_run_without_torch(kind, tmp_path, write_config, tiny_model, arith_data):
    config = write_config(tmp_path / f"{kind}.toml", kind)
    result = run_without_torch("train", kind, "--config", config, "--dry-run")
    assert_ok(result)
    dataset = arith_data["sft" if kind == "sft" else "pref"]
    assert result.stdout == (
        f"dry-run OK: algorithm={kind} model={tiny_model.resolve()} minibatch=4 dataset={dataset.resolve()}\n"
    )
    assert not (tmp_path / "store").exists()  # no store, no run, no backend


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_validate_without_torch(kind, tmp_path, write_config):
    config = write_config(tmp_path / f"{kind}.toml", kind)
    result = run_without_torch("validate", "--config", config)
    assert_ok(result)
    assert result.stdout.startswith(f"config OK: algorithm={kind} "), result.stdout
    assert len(result.stdout.splitlines()) == 1


def test_dry_run_kind_mismatch_without_torch(tmp_path, write_config):
    config = write_config(tmp_path / "sft.toml", "sft")
    result = run_without_torch("train", "rm", "--config", config, "--dry-run")
    assert_user_error(result, "algorithm.kind is 'sft' but this is `rollout train rm`")


@pytest.mark.parametrize(
    "args",
    [["--help"], ["train", "--help"], ["train", "sft", "--help"], ["snapshot", "--help"], ["runs", "--help"]],
    ids=" ".join,
)
def test_help_without_torch(args):
    result = run_without_torch(*args)
    assert_ok(result)
    assert "Usage:" in result.stdout


def test_help_lists_the_commands():
    result = run_without_torch("--help")
    assert_ok(result)
    for command in ("validate", "schema", "train", "snapshot", "runs", "logs", "model", "data"):
        assert command in result.stdout


def test_schema_without_torch():
    result = run_without_torch("schema")
    assert_ok(result)
    schema = json.loads(result.stdout)
    assert {"schema_version", "algorithm", "storage"} <= set(schema["properties"])


def test_light_commands_import_no_torch(tmp_path, write_config):
    """In the normal environment too: importing the CLI, validate and dry-run leave torch unloaded."""
    config = write_config(tmp_path / "sft.toml")
    commands = [["validate", "--config", str(config)], ["train", "sft", "--config", str(config), "--dry-run"]]
    code = f"""
import json, sys
from rollout.cli.main import main
heavy = {HEAVY!r}
loaded = {{"import": [m for m in heavy if m in sys.modules]}}
for argv in {json.dumps(commands)}:
    main(argv)
    loaded[argv[0]] = [m for m in heavy if m in sys.modules]
print(json.dumps(loaded))
"""
    result = run_python(code)
    assert_ok(result)
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded == {"import": [], "validate": [], "train": []}
