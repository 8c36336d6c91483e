"""`rollout runs ...` and `rollout logs tail` through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.store import EventRecord, MetricRecord, open_store

ROLLOUT = Path(sys.executable).parent / "rollout"


def rollout_command(*args: str) -> list[str]:
    return [str(ROLLOUT), *args]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rollout_command(*args), cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def store(tmp_path):
    opened = open_store("embedded", path=tmp_path / "rollout.db")
    yield opened
    opened.close()


def test_runs_list_json_newest_first(store, tmp_path):
    names = ["alpha", "beta", "gamma"]
    runs = [store.create_run(algorithm="sft", config_digest="d", config_json="{}", name=n) for n in names]
    store.set_run_status(runs[1].id, "running")
    result = run_cli("runs", "list", cwd=tmp_path)  # stdout is a pipe: JSON by default
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [r["name"] for r in listed] == ["gamma", "beta", "alpha"]
    assert "config_json" not in listed[0] and listed[0]["status"] == "pending"

    result = run_cli("runs", "list", "--json", "--status", "running", "--limit", "5", cwd=tmp_path)
    assert [r["id"] for r in json.loads(result.stdout)] == [runs[1].id]


def test_runs_show(store, tmp_path):
    run = store.create_run(algorithm="dpo", config_digest="d", config_json='{"seed":1}', name="x")
    store.set_run_status(run.id, "running")
    store.append_metrics(
        [MetricRecord(run.id, s, "train/loss", 1.0 / s) for s in (1, 2, 4)]
        + [MetricRecord(run.id, 1, "train/lr", 0.01)]
    )
    store.set_run_status(run.id, "succeeded")
    result = run_cli("runs", "show", run.id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["id"], shown["status"], shown["config_json"]) == (run.id, "succeeded", '{"seed":1}')
    assert shown["final_metrics"] == {"train/loss": 0.25, "train/lr": 0.01}
    assert (shown["snapshot_count"], shown["snapshot_ids"]) == (0, [])
    assert shown["ended_at"] >= shown["started_at"]


def test_runs_show_unknown_run_exits_2(store, tmp_path):
    result = run_cli("runs", "show", "01NOPE", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: run not found: 01NOPE"
    assert "Traceback" not in result.stderr


def test_logs_tail_prints_events_as_json_lines(store, tmp_path):
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    store.append_events(
        [EventRecord(run.id, seq, 100.0 + seq, "train_step", {"step": seq}) for seq in range(5)]
    )
    result = run_cli("logs", "tail", run.id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {
        "type": "event", "run_id": run.id, "seq": 0, "time": 100.0, "name": "train_step", "fields": {"step": 0}
    }  # fmt: skip
    assert [line["seq"] for line in lines] == [0, 1, 2, 3, 4]
    result = run_cli("logs", "tail", run.id, "--since-seq", "3", cwd=tmp_path)
    assert [json.loads(line)["seq"] for line in result.stdout.splitlines()] == [3, 4]


def test_logs_tail_follow_streams_until_the_run_ends(store, tmp_path):
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    store.set_run_status(run.id, "running")
    store.append_events([EventRecord(run.id, 0, time.time(), "train_start", {})])
    follower = subprocess.Popen(
        rollout_command("logs", "tail", run.id, "--follow", "--interval", "0.05"),
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = json.loads(follower.stdout.readline())  # printed before any further write
        assert (first["seq"], first["name"]) == (0, "train_start")
        for seq in range(1, 21):
            store.append_events([EventRecord(run.id, seq, time.time(), "train_step", {"step": seq})])
            time.sleep(0.01)
        assert follower.poll() is None  # still following a running run
        store.append_events([EventRecord(run.id, 21, time.time(), "train_end", {})])
        store.set_run_status(run.id, "succeeded")
        stdout, stderr = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, stderr
    rest = [json.loads(line) for line in stdout.splitlines()]
    assert [line["seq"] for line in rest] == list(range(1, 22))
    assert rest[-1]["name"] == "train_end"


def test_logs_tail_unknown_run_exits_2(store, tmp_path):
    result = run_cli("logs", "tail", "01NOPE", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: run not found: 01NOPE"
