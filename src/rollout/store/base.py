"""Records and the metadata-store interface.

A `Store` keeps runs, their events and metrics, and snapshot rows (the bytes
live in an `ObjectStore`, see `objects.py`). Every write API takes a batch
(SPEC principle 3); times are float epoch seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

# `crashed`: a `running` run whose heartbeat went stale (its process died without a last word);
# readers mark it with `Store.mark_crashed`, the run itself never writes it.
RunStatus = Literal["pending", "running", "succeeded", "failed", "cancelled", "crashed"]

RUN_STATUSES: frozenset[str] = frozenset(get_args(RunStatus))
TERMINAL_RUN_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "crashed"})


@dataclass(frozen=True)
class RunRecord:
    id: str  # ULID
    algorithm: str
    config_digest: str
    config_json: str
    status: RunStatus
    created_at: float
    started_at: float | None
    ended_at: float | None
    error: str | None
    resumed_from: str | None  # a snapshot id
    name: str | None
    heartbeat_at: float | None = None  # last sign of life while running (see `Store.heartbeat`)


@dataclass(frozen=True)
class EventRecord:
    run_id: str
    seq: int  # monotonic per run, starting at 0
    time: float
    name: str  # e.g. "train_step", "snapshot_saved"
    fields: dict = field(default_factory=dict)  # JSON-serialisable


@dataclass(frozen=True)
class MetricRecord:
    run_id: str
    step: int
    name: str  # namespaced, e.g. "train/loss"
    value: float


@dataclass(frozen=True)
class SnapshotRecord:
    id: str  # blake3 hex (64) of the canonical manifest
    run_id: str
    kind: str  # train_state | buffer | episodic_memory | process
    step: int
    label: str | None
    parent_id: str | None
    created_at: float
    manifest: dict  # blob digests, sizes, tensor dtypes/shapes, extra
    metadata: dict  # free-form, not part of the id


@dataclass(frozen=True)
class RunSummary:
    """What a run listing shows besides the record (`Store.summarize_runs`)."""

    run_id: str
    last_step: int | None  # the highest step with any metric
    latest: dict[str, float]  # each requested metric name at its own last step (absent if never logged)
    last_train_state_id: str | None  # the newest train_state snapshot: where a resume would start


class Store(Protocol):
    """Runs, events, metrics and snapshot rows. Implemented by `SqlStore`."""

    def create_run(
        self,
        *,
        algorithm: str,
        config_digest: str,
        config_json: str,
        name: str | None = None,
        resumed_from: str | None = None,
    ) -> RunRecord:
        """Insert a new run with a fresh ULID id and status `pending`."""
        ...

    def set_run_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None:
        """Move a run to `status`.

        `running` stamps `started_at` (once) and `heartbeat_at`; a terminal status stamps `ended_at`.
        """
        ...

    def heartbeat(self, run_id: str) -> bool:
        """Set the run's `heartbeat_at` to now if it is `running`; returns whether it was."""
        ...

    def mark_crashed(self, *, timeout_s: float) -> list[str]:
        """Mark `crashed` every running run with no heartbeat (else start) for `timeout_s`; returns their ids.

        One conditional statement, so a heartbeat that lands first keeps its run alive
        and two readers marking at once mark each run once.
        """
        ...

    def get_run(self, run_id: str) -> RunRecord:
        """By full id or a unique prefix of >= 10 chars (the ULID's time part), else `RunNotFound`."""
        ...

    def list_runs(self, *, limit: int | None = None, status: str | None = None) -> list[RunRecord]:
        """Runs, newest first."""
        ...

    def append_events(self, events: Sequence[EventRecord]) -> None:
        """Insert a batch of events in one transaction."""
        ...

    def read_events(self, run_id: str, *, after_seq: int = -1, limit: int | None = None) -> list[EventRecord]:
        """A run's events with `seq > after_seq`, ordered by seq."""
        ...

    def append_metrics(self, metrics: Sequence[MetricRecord]) -> None:
        """Upsert a batch of metrics on (run_id, step, name) in one transaction."""
        ...

    def read_metrics(self, run_id: str, *, name: str | None = None) -> list[MetricRecord]:
        """A run's metrics ordered by (step, name)."""
        ...

    def final_metrics(self, run_id: str) -> dict[str, float]:
        """Each metric name's value at its last step."""
        ...

    def summarize_runs(self, run_ids: Sequence[str], *, metric_names: Sequence[str]) -> dict[str, RunSummary]:
        """A `RunSummary` per known run id, for listings: a fixed number of queries, not one per run."""
        ...

    def add_snapshot(self, record: SnapshotRecord) -> None:
        """Insert a snapshot row; a no-op when a row with the same id exists."""
        ...

    def get_snapshot(self, id_or_prefix: str) -> SnapshotRecord:
        """By full id or a unique hex prefix of >= 8 chars, else `SnapshotNotFound`."""
        ...

    def list_snapshots(
        self, *, run_id: str | None = None, kind: str | None = None, limit: int | None = None
    ) -> list[SnapshotRecord]:
        """Snapshots, newest first (created_at desc, then step desc)."""
        ...

    def delete_snapshots(self, ids: Sequence[str]) -> int:
        """Delete snapshot rows (not blobs); returns how many rows went."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
