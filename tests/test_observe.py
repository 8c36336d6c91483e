"""RunRecorder over a real SQLite store and a real JSONL file."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rollout.errors import ConfigError, StorageError
from rollout.observe import Heartbeat, RunRecorder
from rollout.store import EventRecord, open_store


@pytest.fixture
def store(tmp_path):
    opened = open_store("embedded", path=tmp_path / "rollout.db")
    yield opened
    opened.close()


@pytest.fixture
def run_id(store):
    return store.create_run(algorithm="sft", config_digest="d", config_json="{}").id


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_events_and_metrics_reach_store_and_jsonl(store, run_id, tmp_path):
    jsonl = tmp_path / "runs" / run_id / "events.jsonl"
    with RunRecorder(store, run_id, jsonl) as recorder:
        recorder.event("train_start", algorithm="sft")
        recorder.metrics(1, {"train/loss": 2.5, "train/lr": 0.001})
        recorder.event("train_step", step=1, note="ü")
        recorder.metrics(2, {"train/loss": 2.0})
        recorder.flush()
        assert [e.name for e in store.read_events(run_id)] == ["train_start", "train_step"]
        assert store.final_metrics(run_id) == {"train/loss": 2.0, "train/lr": 0.001}

    lines = read_jsonl(jsonl)
    assert [line["type"] for line in lines] == ["event", "metric", "metric", "event", "metric"]
    first = lines[0]
    assert set(first) == {"type", "run_id", "seq", "time", "name", "fields"}
    assert (first["run_id"], first["seq"], first["name"], first["fields"]) == (
        run_id,
        0,
        "train_start",
        {"algorithm": "sft"},
    )
    assert lines[1] == {"type": "metric", "run_id": run_id, "step": 1, "name": "train/loss", "value": 2.5}
    assert lines[3]["fields"] == {"step": 1, "note": "ü"}
    stored = store.read_events(run_id)
    assert [(e.seq, e.time, e.fields) for e in stored] == [
        (line["seq"], line["time"], line["fields"]) for line in lines if line["type"] == "event"
    ]


def test_seq_is_monotonic_and_continues_after_existing_events(store, run_id):
    store.append_events([EventRecord(run_id, seq, 1.0, "old", {}) for seq in range(3)])
    with RunRecorder(store, run_id, None) as recorder:
        for i in range(5):
            recorder.event("new", i=i)
    assert [(e.seq, e.name) for e in store.read_events(run_id)] == [(i, "old") for i in range(3)] + [
        (i, "new") for i in range(3, 8)
    ]
    with RunRecorder(store, run_id, None) as recorder:
        recorder.event("again")
    assert store.read_events(run_id)[-1].seq == 8


def test_seq_is_unique_across_threads(store, run_id):
    with RunRecorder(store, run_id, None) as recorder:
        threads = [
            threading.Thread(target=lambda: [recorder.event("tick") for _ in range(200)]) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [e.seq for e in store.read_events(run_id)] == list(range(800))


class SlowStore:
    """The real store, with a slow append: shows the producer never waits on storage."""

    def __init__(self, store, delay_s: float) -> None:
        self._store, self._delay_s = store, delay_s

    def append_records(self, events, metrics):  # what the recorder's writer calls, once per batch
        time.sleep(self._delay_s)
        self._store.append_records(events, metrics)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_producer_never_blocks_and_flush_waits(store, run_id):
    recorder = RunRecorder(SlowStore(store, delay_s=0.3), run_id, None)
    started = time.perf_counter()
    for step in range(50):
        recorder.event("train_step", step=step)
        recorder.metrics(step, {"train/loss": 1.0 / (step + 1)})
    assert time.perf_counter() - started < 0.2
    recorder.flush()
    assert len(store.read_events(run_id)) == 50
    assert len(store.read_metrics(run_id)) == 50
    recorder.close()
    recorder.close()  # idempotent
    with pytest.raises(StorageError, match="closed"):
        recorder.event("late")


def test_writer_error_surfaces_as_storage_error(store, tmp_path):
    # A run id the store doesn't know: the batch insert fails on the writer thread.
    recorder = RunRecorder(store, "no-such-run", tmp_path / "events.jsonl")
    recorder.event("train_start")
    with pytest.raises(StorageError, match="constraint"):
        recorder.flush()
    with pytest.raises(StorageError, match="constraint"):
        recorder.event("train_step")
    with pytest.raises(StorageError, match="constraint"):
        recorder.close()
    # The local log still holds what the store refused.
    assert [line["name"] for line in read_jsonl(tmp_path / "events.jsonl")] == ["train_start"]


def test_bad_values_fail_at_the_call_site(store, run_id):
    with RunRecorder(store, run_id, None) as recorder:
        with pytest.raises(StorageError, match="not JSON-serialisable"):
            recorder.event("bad", thing=object())
        with pytest.raises(StorageError, match="must be a number"):
            recorder.metrics(0, {"train/loss": "high"})
        recorder.event("fine", loss=float("nan"))
    assert [e.name for e in store.read_events(run_id)] == ["fine"]


def test_extra_sinks_get_every_batch_after_the_file_and_the_store(store, run_id, tmp_path):
    class ListSink:
        def __init__(self) -> None:
            self.records, self.closed, self.store_had = [], False, []

        def write(self, records):
            self.store_had.append(len(store.read_events(run_id)))  # the store sink wrote first
            self.records.extend(records)

        def close(self):
            self.closed = True

    sink = ListSink()
    with RunRecorder(store, run_id, tmp_path / "events.jsonl", sinks=[sink]) as recorder:
        recorder.event("train_start", algorithm="sft")
        recorder.metrics(1, {"train/loss": 2.5})
        recorder.flush()
    assert [type(r).__name__ for r in sink.records] == ["EventRecord", "MetricRecord"]
    assert sink.store_had[0] == 1 and sink.closed
    assert len(read_jsonl(tmp_path / "events.jsonl")) == 2


# -- Heartbeat -----------------------------------------------------------------


def test_heartbeat_advances_while_the_run_is_running(store, run_id):
    store.set_run_status(run_id, "running")
    first = store.get_run(run_id).heartbeat_at
    with Heartbeat(store, run_id, interval_s=0.05) as heartbeat:
        deadline = time.monotonic() + 10
        while store.get_run(run_id).heartbeat_at == first and time.monotonic() < deadline:
            time.sleep(0.02)
        second = store.get_run(run_id).heartbeat_at
        assert second > first
        time.sleep(0.2)
        assert store.get_run(run_id).heartbeat_at > second  # it keeps beating
    stopped = store.get_run(run_id).heartbeat_at
    time.sleep(0.2)
    assert store.get_run(run_id).heartbeat_at == stopped  # and stops with the context
    assert (heartbeat.failures, heartbeat.error) == (0, None)


def test_heartbeat_shares_the_store_with_the_recorder_thread(store, run_id):
    # SqlStore checks a pooled connection out per call, so a second writer thread is safe.
    store.set_run_status(run_id, "running")
    with (
        Heartbeat(store, run_id, interval_s=0.001) as heartbeat,
        RunRecorder(store, run_id, None) as recorder,
    ):
        for step in range(300):
            recorder.event("train_step", step=step)
            recorder.metrics(step, {"train/loss": 1.0})
            if step % 50 == 0:
                recorder.flush()
    assert (heartbeat.failures, heartbeat.error) == (0, None)
    assert len(store.read_events(run_id)) == 300 and len(store.read_metrics(run_id)) == 300
    assert store.mark_crashed(timeout_s=30.0) == []


class FailingStore:
    """A store whose heartbeat fails `failures` times, then works."""

    def __init__(self, store, failures: int) -> None:
        self._store, self.left = store, failures

    def heartbeat(self, run_id):
        if self.left > 0:
            self.left -= 1
            raise StorageError("cannot record a heartbeat in the store: connection refused")
        return self._store.heartbeat(run_id)


def test_heartbeat_failures_are_kept_and_do_not_stop_it(store, run_id, capsys):
    store.set_run_status(run_id, "running")
    failing = FailingStore(store, failures=3)
    before = store.get_run(run_id).heartbeat_at
    with Heartbeat(failing, run_id, interval_s=0.02) as heartbeat:
        deadline = time.monotonic() + 10
        while store.get_run(run_id).heartbeat_at == before and time.monotonic() < deadline:
            time.sleep(0.02)
    assert heartbeat.failures == 3 and "connection refused" in str(heartbeat.error)
    assert store.get_run(run_id).heartbeat_at > before  # beating again once the store is back
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        "warning: cannot record a heartbeat in the store: connection refused (retrying every 0.02 s)"
    ]


def test_heartbeat_on_a_run_that_is_no_longer_running_warns_once(store, run_id, capsys):
    with Heartbeat(store, run_id, interval_s=0.01):  # the run is still pending
        time.sleep(0.1)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: run {run_id} is no longer `running` in the store; heartbeats have no effect"
    ]


def test_heartbeat_interval_from_the_environment(store, run_id, monkeypatch):
    monkeypatch.delenv("ROLLOUT_HEARTBEAT_S", raising=False)
    assert Heartbeat(store, run_id).interval_s == 5.0
    monkeypatch.setenv("ROLLOUT_HEARTBEAT_S", "0.25")
    assert Heartbeat(store, run_id).interval_s == 0.25
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("ROLLOUT_HEARTBEAT_S", bad)
        with pytest.raises(ConfigError, match="ROLLOUT_HEARTBEAT_S must be a positive number of seconds"):
            Heartbeat(store, run_id)


def test_heartbeat_stop_is_prompt_and_idempotent(store, run_id):
    heartbeat = Heartbeat(store, run_id, interval_s=60.0).start()
    started = time.perf_counter()
    heartbeat.stop()
    heartbeat.stop()
    assert time.perf_counter() - started < 1.0
