"""Records and the metadata-store interface.

A `Store` keeps runs, their events and metrics, snapshot rows (the bytes
live in an `ObjectStore`, see `objects.py`), and evals with one row per
sample. Every write API takes a batch (SPEC principle 3); times are float
epoch seconds.
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

# An eval's lifecycle is a run's: `crashed` once a `running` eval's heartbeat goes stale.
EvalStatus = RunStatus
EVAL_STATUSES = RUN_STATUSES


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


@dataclass(frozen=True)
class EvalRecord:
    """One `rollout eval`: what was evaluated on what, how it was sampled, and the summary.

    `config_json` is the eval's full config (never an API key): `rollout eval --resume`
    rebuilds the eval from it. `summary` is `{"n_prompts", "n_samples", "ks", "metrics",
    "not_computable"}` once the eval has finished (see `rollout.eval.metrics.EvalSummary`).
    """

    id: str  # ULID
    name: str | None
    status: EvalStatus
    created_at: float
    started_at: float | None
    ended_at: float | None
    heartbeat_at: float | None
    model: str  # as the user named it: a folder, `snapshot:<id>`, or `<base_url> <served name>`
    model_identity: str | None  # files:<blake3> | snapshot:<id> | openai:<url>:<name>
    engine: str  # hf | openai
    env: str  # built-in env name or module:attr
    data_path: str | None
    data_digest: str | None  # blake3 of the data file's bytes
    n_prompts: int
    n: int  # samples per prompt
    seed: int
    success_threshold: float
    sampling: dict  # temperature, top_p, max_tokens, stop, max_turns
    config_json: str
    run_id: str | None = None  # set for an eval during training
    step: int | None = None
    summary: dict | None = None
    timings: dict | None = None
    error: str | None = None


@dataclass(frozen=True)
class EvalSampleRecord:
    """One scored sample of an eval: prompt `prompt_index` (0-based data row), sample `sample_index`.

    `messages` is the whole episode as chat messages (the env's opening messages, then each
    assistant turn and env reply); `completion` is the last assistant message's text.
    `failed` marks a sample that could not be produced (the engine kept failing): its reward
    is None and `error` says why. Token counts sum over the episode's turns; `truncated` is
    true when a turn hit max_tokens or the episode hit max_turns.
    """

    prompt_index: int
    sample_index: int
    seed: int
    reward: float | None
    success: bool
    failed: bool
    answer: str | None
    completion: str | None
    messages: list[dict]
    turns: int
    tool_calls: int
    finish_reason: str | None  # the last turn's (stop | length | cancelled), max_turns, or None if failed
    prompt_tokens: int
    completion_tokens: int
    truncated: bool
    error: str | None = None
    created_at: float = 0.0

    def to_dict(self) -> dict:
        """The JSON-able row, as `rollout eval --output` writes it (the eval id added by the caller)."""
        return {name: getattr(self, name) for name in EVAL_SAMPLE_FIELDS}


EVAL_SAMPLE_FIELDS: tuple[str, ...] = (
    "prompt_index",
    "sample_index",
    "seed",
    "reward",
    "success",
    "failed",
    "answer",
    "completion",
    "messages",
    "turns",
    "tool_calls",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "truncated",
    "error",
    "created_at",
)


class Store(Protocol):
    """Runs, events, metrics, snapshot rows, evals and their samples. Implemented by `SqlStore`."""

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
        """Mark `crashed` every running run with no heartbeat (else start) for `timeout_s`, and every
        `pending` run created that long ago (killed before its first beat); returns their ids.

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

    def append_records(self, events: Sequence[EventRecord], metrics: Sequence[MetricRecord]) -> None:
        """Insert events and upsert metrics (as the two above) in one transaction: both or neither."""
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

    def create_eval(
        self,
        *,
        model: str,
        model_identity: str | None,
        engine: str,
        env: str,
        data_path: str | None,
        data_digest: str | None,
        n_prompts: int,
        n: int,
        seed: int,
        success_threshold: float,
        sampling: dict,
        config_json: str,
        name: str | None = None,
        run_id: str | None = None,
        step: int | None = None,
    ) -> EvalRecord:
        """Insert a new eval with a fresh ULID id and status `pending`."""
        ...

    def set_eval_status(
        self,
        eval_id: str,
        status: EvalStatus,
        *,
        error: str | None = None,
        summary: dict | None = None,
        timings: dict | None = None,
    ) -> None:
        """Move an eval to `status` (stamps like `set_run_status`); `running` clears a previous error."""
        ...

    def eval_heartbeat(self, eval_id: str) -> bool:
        """Set the eval's `heartbeat_at` to now if it is `running`; returns whether it was."""
        ...

    def mark_crashed_evals(self, *, timeout_s: float) -> list[str]:
        """`mark_crashed` for evals: running evals silent for `timeout_s` become `crashed`."""
        ...

    def get_eval(self, eval_id: str) -> EvalRecord:
        """By full id or a unique prefix of >= 10 chars, else `EvalNotFound`."""
        ...

    def list_evals(
        self, *, limit: int | None = None, status: str | None = None, run_id: str | None = None
    ) -> list[EvalRecord]:
        """Evals, newest first."""
        ...

    def add_eval_samples(self, eval_id: str, samples: Sequence[EvalSampleRecord]) -> None:
        """Insert a batch of samples in one transaction; a (prompt, sample) already stored is kept as is."""
        ...

    def read_eval_samples(self, eval_id: str) -> list[EvalSampleRecord]:
        """An eval's samples ordered by (prompt_index, sample_index)."""
        ...

    def count_eval_samples(self, eval_ids: Sequence[str]) -> dict[str, int]:
        """How many samples each eval has stored (evals with none are absent)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
