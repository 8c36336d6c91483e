"""`rollout runs ...` and `rollout logs tail` through the installed console script.

Tables are read under a pseudo-terminal (`cli_terminal`); piped output and `--json` are JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from cli_terminal import run_in_terminal, table_rows

from rollout.snapshots import Blob, commit_snapshot
from rollout.store import EventRecord, FsObjectStore, MetricRecord, open_store

ROLLOUT = Path(sys.executable).parent / "rollout"


def rollout_command(*args: str) -> list[str]:
    return [str(ROLLOUT), *args]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rollout_command(*args), cwd=cwd, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


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


# -- crashed runs and tables ---------------------------------------------------


def go_quiet(store, run_id: str, seconds: float) -> None:
    """Move a running run's times `seconds` into the past: it was made then and went quiet at once."""
    with store._engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE runs SET created_at = created_at - :s, started_at = started_at - :s,"
                " heartbeat_at = heartbeat_at - :s WHERE id = :id"
            ),
            {"s": seconds, "id": run_id},
        )


@pytest.fixture
def listed(store, tmp_path):
    """A run that died at step 3 (snapshot at step 2), a finished RL run and a pending one."""
    objects = FsObjectStore(tmp_path / "object-store")
    died = store.create_run(algorithm="sft", config_digest="d", config_json="{}", name="sft [died]")
    store.set_run_status(died.id, "running")
    store.append_metrics([MetricRecord(died.id, s, "train/loss", 1.0 / 2**s) for s in (1, 2, 3)])
    snapshot = commit_snapshot(
        store, objects, run_id=died.id, kind="train_state", step=2,
        blobs={"model": Blob(b"w" * 3000, meta={"tensors": {"w": {"dtype": "float32", "shape": [750]}}})},
    )  # fmt: skip
    go_quiet(store, died.id, 120.0)
    rl = store.create_run(algorithm="grpo", config_digest="d", config_json="{}", name="rl")
    store.set_run_status(rl.id, "running")
    store.append_metrics(
        [MetricRecord(rl.id, 4, "train/loss", 0.5), MetricRecord(rl.id, 4, "rollout/reward_mean", 0.75)]
    )
    store.set_run_status(rl.id, "succeeded")
    waiting = store.create_run(algorithm="dpo", config_digest="d", config_json="{}", name="waiting")
    return died, snapshot, rl, waiting


def test_runs_list_table_on_a_terminal(store, listed, tmp_path):
    died, snapshot, rl, waiting = listed
    text = run_in_terminal(rollout_command("runs", "list"), cwd=tmp_path, env=clean_env())
    rows = table_rows(text)
    assert rows[0] == ["id", "name", "algorithm", "status", "step", "age", "duration", "metric", "resume"]
    by_id = {row[0]: row for row in rows[1:]}
    assert set(by_id) == {died.id[:10], rl.id[:10], waiting.id[:10]}
    assert by_id[died.id[:10]] == [
        died.id[:10],
        "sft [died]",
        "sft",
        "crashed",
        "3",
        "2m ago",
        "0:00:00",
        "loss 0.125",
        snapshot.id[:12],
    ]  # the duration ends at the last heartbeat; resume from the step-2 snapshot
    assert by_id[rl.id[:10]][1:5] == ["rl", "grpo", "succeeded", "4"]
    assert by_id[rl.id[:10]][-1] == "reward 0.75"  # the RL reward wins over the loss
    assert by_id[waiting.id[:10]][1:4] == ["waiting", "dpo", "pending"]
    assert store.get_run(died.id).status == "crashed"  # noticed once, stored for everyone


def test_runs_list_json_on_a_terminal_and_piped(store, listed, tmp_path):
    died, *_ = listed
    piped = run_cli("runs", "list", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    as_json = run_in_terminal(rollout_command("runs", "list", "--json"), cwd=tmp_path, env=clean_env())
    for listed_runs in (json.loads(piped.stdout), json.loads(as_json)):
        assert [r["name"] for r in listed_runs] == ["waiting", "rl", "sft [died]"]  # newest first
        crashed = listed_runs[-1]
        assert (crashed["id"], crashed["status"]) == (died.id, "crashed")
        assert crashed["error"] == "no heartbeat for 60 s (process died?)"
        assert crashed["ended_at"] == crashed["heartbeat_at"] and "config_json" not in crashed


def test_runs_show_tables_on_a_terminal(store, listed, tmp_path):
    died, snapshot, *_ = listed
    text = run_in_terminal(rollout_command("runs", "show", died.id[:10]), cwd=tmp_path, env=clean_env())
    rows = table_rows(text)
    fields: dict[str, list[str]] = {}
    for row in rows:  # the first table's keys come first (the snapshots table has an "id" header too)
        fields.setdefault(row[0], row[1:])
    assert fields["id"] == [died.id] and fields["status"] == ["crashed"] and fields["name"] == ["sft [died]"]
    assert fields["error"] == ["no heartbeat for 60 s (process died?)"]
    assert fields["resume from"] == [snapshot.id]
    assert fields["resume with"] == [f"rollout train sft --config CONFIG --resume {snapshot.id[:12]}"]
    assert fields["train/loss"] == ["0.125"]  # the final metrics table
    assert rows[-1][:3] == [snapshot.id[:12], "train_state", "2"]  # the snapshots table
    assert rows[-1][-1] == "2.9 KiB"
    assert "snapshots (1)" in text and "final metrics" in text


def test_runs_show_json_has_resume_from(store, listed, tmp_path):
    died, snapshot, rl, _ = listed
    result = run_cli("runs", "show", died.id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["status"], shown["resume_from"], shown["snapshot_ids"]) == (
        "crashed",
        snapshot.id,
        [snapshot.id],
    )
    on_terminal = run_in_terminal(
        rollout_command("runs", "show", rl.id, "--json"), cwd=tmp_path, env=clean_env()
    )
    shown = json.loads(on_terminal)
    assert (shown["status"], shown["resume_from"]) == ("succeeded", None)  # nothing to resume


def test_heartbeat_timeout_from_flag_and_environment(store, tmp_path):
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    store.set_run_status(run.id, "running")
    go_quiet(store, run.id, 5.0)
    for args, env in [((), {}), (("--heartbeat-timeout", "30"), {"ROLLOUT_HEARTBEAT_TIMEOUT": "1"})]:
        result = run_cli("runs", "list", *args, cwd=tmp_path, env=env)
        assert json.loads(result.stdout)[0]["status"] == "running", result.stderr  # 5 s is not 60 (or 30)
    result = run_cli("runs", "show", run.id, cwd=tmp_path, env={"ROLLOUT_HEARTBEAT_TIMEOUT": "3"})
    shown = json.loads(result.stdout)
    assert (shown["status"], shown["error"]) == ("crashed", "no heartbeat for 3 s (process died?)")
    assert shown["resume_from"] is None  # it died before its first snapshot
    result = run_cli("runs", "list", "--heartbeat-timeout", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--heartbeat-timeout" in result.stderr


def test_logs_tail_follow_ends_when_the_run_crashes(store, tmp_path):
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    store.set_run_status(run.id, "running")  # and then nothing: no heartbeat, no final status
    store.append_events([EventRecord(run.id, 0, time.time(), "train_start", {})])
    started = time.monotonic()
    result = subprocess.run(
        rollout_command("logs", "tail", run.id[:10], "--follow", "--interval", "0.05", "--heartbeat-timeout", "1"),
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["name"] for line in result.stdout.splitlines()] == ["train_start"]
    assert time.monotonic() - started >= 1.0
    assert store.get_run(run.id).status == "crashed"
