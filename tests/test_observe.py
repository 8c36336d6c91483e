"""RunRecorder over a real SQLite store and a real JSONL file."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rollout.errors import StorageError
from rollout.observe import RunRecorder
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

    def append_events(self, events):
        time.sleep(self._delay_s)
        self._store.append_events(events)

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
