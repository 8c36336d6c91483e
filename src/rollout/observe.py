"""`RunRecorder`: a run's events and metrics, written to a list of sinks (the JSONL file, the store);
`Heartbeat`: a running run's sign of life, so readers can tell a dead run from a live one.

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

A run killed with SIGKILL never writes its final status. While it runs, a
`Heartbeat` thread stamps the run's `heartbeat_at` every `$ROLLOUT_HEARTBEAT_S`
seconds (default 5); `rollout runs list` marks a running run `crashed` once
that stamp is older than its `--heartbeat-timeout` (default 60 s):

    with Heartbeat(store, run.id):
        train()
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

from rollout.errors import ConfigError, StorageError
from rollout.store.base import EventRecord, MetricRecord, Store

COALESCE_S = 0.2
HEARTBEAT_ENV = "ROLLOUT_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 5.0
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
    """The metadata store: one transaction per batch (events and metrics). The store itself belongs to the run."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        self._store.append_records(
            [r for r in records if isinstance(r, EventRecord)], [r for r in records if isinstance(r, MetricRecord)]
        )

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


def _as_storage_error(
    err: Exception, run_id: str, *, action: str = "record events/metrics of"
) -> StorageError:
    if isinstance(err, StorageError):
        return err
    wrapped = StorageError(f"cannot {action} run {run_id}: {type(err).__name__}: {err}")
    wrapped.__cause__ = err
    return wrapped


# --------------------------------------------------------------------------- heartbeat


def heartbeat_interval_s() -> float:
    """Seconds between heartbeats: `$ROLLOUT_HEARTBEAT_S`, else 5."""
    raw = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not raw:
        return DEFAULT_HEARTBEAT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"${HEARTBEAT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


class Heartbeat:
    """Stamps a running run's `heartbeat_at` every `interval_s` seconds from a background thread.

    A failed beat must not stop training (the store may be back before any reader's
    timeout), so it is kept in `error`, counted in `failures`, and reported on
    stderr once per streak of failures; the thread keeps beating.
    """

    def __init__(self, store: Store, run_id: str, *, interval_s: float | None = None) -> None:
        self.interval_s = heartbeat_interval_s() if interval_s is None else interval_s
        if not self.interval_s > 0:
            raise ConfigError(f"heartbeat interval must be > 0 seconds, got {self.interval_s}")
        self.error: StorageError | None = None
        self.failures = 0
        self._store = store
        self._run_id = run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat_until_stopped, name=f"heartbeat-{run_id}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; returns once the thread is gone (at most one store call later). Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _beat_until_stopped(self) -> None:
        failing, warned_not_running = False, False
        while not self._stop.wait(self.interval_s):
            try:
                running = self._store.heartbeat(self._run_id)
            except Exception as err:  # kept, counted and reported; training goes on
                self.error = _as_storage_error(err, self._run_id, action="record the heartbeat of")
                self.failures += 1
                if not failing:
                    _warn(f"{self.error} (retrying every {self.interval_s:g} s)")
                failing = True
                continue
            failing = False
            if not running and not warned_not_running:
                # A reader saw no heartbeat for its timeout (a long stall?) and marked the run crashed;
                # the run's final status still overwrites that when it ends.
                _warn(f"run {self._run_id} is no longer `running` in the store; heartbeats have no effect")
                warned_not_running = True


def _warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()
