"""`RunRecorder`: a run's events and metrics, written to a list of sinks (the JSONL file, the store).

The training loop calls `event(...)` / `metrics(...)`, which only enqueue; a
background thread drains the queue in batches and hands each batch to every
`RecordSink` in turn (the store sink writes one transaction per batch and
kind) so the loop never waits on disk or network. A writer failure is kept
and re-raised as `StorageError` from the next call, so it is never lost:

    with RunRecorder(store, run.id, run_dir / "events.jsonl") as recorder:
        recorder.event("train_start", algorithm="sft")
        recorder.metrics(step, {"train/loss": 1.25, "train/lr": 1e-3})

JSONL lines: `{"type":"event","run_id","seq","time","name","fields"}` and
`{"type":"metric","run_id","step","name","value"}` (non-finite floats are
written as Python's `NaN` / `Infinity`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

from rollout.errors import StorageError
from rollout.store.base import EventRecord, MetricRecord, Store

COALESCE_S = 0.2
MAX_BATCH = 1000
_SEQ_PAGE = 10_000


class _Flush:
    """A queue marker: set once everything queued before it is written."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class RecordSink(Protocol):
    """Where the recorder's writer thread puts each batch of records (in queue order)."""

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """The run's local log (`events.jsonl`), flushed and fsynced per batch."""

    def __init__(self, path: Path) -> None:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise StorageError(f"cannot open the event log {path}: {err}") from err

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        self._file.writelines(_jsonl_line(record) for record in records)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class StoreSink:
    """The metadata store: one transaction per batch and kind. The store itself belongs to the run."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        self._store.append_events([r for r in records if isinstance(r, EventRecord)])
        self._store.append_metrics([r for r in records if isinstance(r, MetricRecord)])

    def close(self) -> None:
        pass


class RunRecorder:
    """Queues a run's events and metrics and writes them from a background thread.

    Sinks, in order: the JSONL file at `jsonl_path` (if given), the store, then
    any `sinks` passed in (a dashboard feed, a remote tracker, ...).
    """

    def __init__(
        self, store: Store, run_id: str, jsonl_path: Path | None, *, sinks: Sequence[RecordSink] = ()
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._next_seq = _next_event_seq(store, run_id)
        self._lock = threading.Lock()
        self._queue: queue.Queue[object] = queue.Queue()
        self._error: StorageError | None = None
        self._closed = False
        # The local file first: if the store is down, the run's log still has everything.
        self._sinks: list[RecordSink] = [*([JsonlSink(jsonl_path)] if jsonl_path is not None else []),
                                         StoreSink(store), *sinks]
        self._writer = threading.Thread(target=self._drain, name=f"run-recorder-{run_id}", daemon=True)
        self._writer.start()

    # -- producer side (the training loop) ----------------------------------

    def event(self, name: str, **fields: object) -> None:
        """Queue an event; `seq` continues after the run's existing events."""
        try:
            json.dumps(fields, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise StorageError(f"event {name!r}: fields are not JSON-serialisable: {err}") from err
        with self._lock:
            self._check_usable()
            record = EventRecord(self._run_id, self._next_seq, time.time(), name, dict(fields))
            self._next_seq += 1
            self._queue.put(record)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Queue one value per metric name at `step`."""
        try:
            records = [MetricRecord(self._run_id, int(step), name, float(v)) for name, v in values.items()]
        except (TypeError, ValueError) as err:
            raise StorageError(f"metrics at step {step}: every value must be a number ({err})") from err
        with self._lock:
            self._check_usable()
            for record in records:
                self._queue.put(record)

    def flush(self) -> None:
        """Block until everything queued so far is in the store and the JSONL file (fsynced)."""
        with self._lock:
            self._check_usable()
            marker = _Flush()
            self._queue.put(marker)
        marker.done.wait()
        self._raise_error()

    def close(self) -> None:
        """Flush, stop the writer and close the JSONL file; re-raises a writer error."""
        with self._lock:
            if self._closed:
                self._raise_error()
                return
            self._closed = True
            self._queue.put(_STOP)
        self._writer.join()
        for sink in self._sinks:
            sink.close()
        self._raise_error()

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise StorageError(f"the recorder of run {self._run_id} is closed")
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise StorageError(str(self._error), details=self._error.details) from self._error

    # -- consumer side (the writer thread) ----------------------------------

    def _drain(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            # Coalesce for up to COALESCE_S so a fast loop costs a few writes a second, not one
            # per step (each write fsyncs and holds the GIL); flush() and close() cut the wait short.
            deadline = time.monotonic() + COALESCE_S
            while len(batch) < MAX_BATCH and not isinstance(batch[-1], _Flush) and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            records = [item for item in batch if isinstance(item, EventRecord | MetricRecord)]
            if records and self._error is None:
                try:
                    self._write(records)
                except Exception as err:  # kept and re-raised to the producer, never swallowed
                    self._error = _as_storage_error(err, self._run_id)
            for item in batch:
                if isinstance(item, _Flush):
                    item.done.set()
                stop = stop or item is _STOP

    def _write(self, records: list[EventRecord | MetricRecord]) -> None:
        for sink in self._sinks:
            sink.write(records)


def _next_event_seq(store: Store, run_id: str) -> int:
    last = -1
    while page := store.read_events(run_id, after_seq=last, limit=_SEQ_PAGE):
        last = page[-1].seq
    return last + 1


def _jsonl_line(record: EventRecord | MetricRecord) -> str:
    if isinstance(record, EventRecord):
        line = {
            "type": "event",
            "run_id": record.run_id,
            "seq": record.seq,
            "time": record.time,
            "name": record.name,
            "fields": record.fields,
        }
    else:
        line = {
            "type": "metric",
            "run_id": record.run_id,
            "step": record.step,
            "name": record.name,
            "value": record.value,
        }
    return json.dumps(line, ensure_ascii=False) + "\n"


def _as_storage_error(err: Exception, run_id: str) -> StorageError:
    if isinstance(err, StorageError):
        return err
    wrapped = StorageError(f"cannot record events/metrics of run {run_id}: {type(err).__name__}: {err}")
    wrapped.__cause__ = err
    return wrapped
