"""Bad preference / KTO lines are refused at plan time with `file:line: ...`, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from integration_helpers import example_config

GOOD = {"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"}


def _run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "rollout.cli.main", *args], capture_output=True, text=True, env=env)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "What is 1+1?", "chosen": "2"}, 'missing field "rejected"'),
        ({"prompt": "What is 1+1?", "chosen": "", "rejected": "3"}, '"chosen"'),
        ({"prompt": "What is 1+1?", "chosen": "2", "rejected": "2"}, "chosen and rejected are identical"),
    ],
)
@pytest.mark.parametrize("command", [("validate",), ("train", "dpo")])
def test_bad_preference_line_is_located(bad, message, command, workspace, tmp_path):
    data = tmp_path / "pref.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in (GOOD, GOOD, bad, GOOD)) + "\n")
    config = example_config("dpo-tiny.toml", workspace, tmp_path, {
        '"../local/data/arithmetic/pref.jsonl"': f'"{data}"', '"../local/models/sft-tiny"': '"../local/models/tiny"',
    })
    out = _run(*command, "--config", str(config))
    assert out.returncode == 2, out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith(f"error: {data}:3: ") and message in first, first
    assert "Traceback" not in out.stderr


def test_kto_line_needs_a_boolean_label(workspace, tmp_path):
    data = tmp_path / "kto.jsonl"
    data.write_text(json.dumps({"prompt": "p", "completion": "c", "label": "yes"}) + "\n")
    config = example_config("kto-tiny.toml", workspace, tmp_path, {'"../local/data/arithmetic/kto.jsonl"': f'"{data}"'})
    out = _run("validate", "--config", str(config))
    assert out.returncode == 2 and out.stderr.startswith(f"error: {data}:1: "), out.stderr
    assert "label" in out.stderr.splitlines()[0]


def test_dpo_dry_run_line(workspace, tmp_path):
    config = example_config("dpo-tiny.toml", workspace, tmp_path)
    out = _run("train", "dpo", "--config", str(config), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("dry-run OK: algorithm=dpo model=") and "minibatch=16" in out.stdout
