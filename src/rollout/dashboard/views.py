"""What the dashboard's JSON API returns: store records turned into JSON-able dicts.

Pure functions of records and the clock (no HTTP, no store), so the shapes are
tested on their own. Two rules hold everywhere:

- JSON has no NaN or infinity: a metric value that is not finite becomes
  `null` (a gap in the plot); inside free-form fields (events, eval summaries)
  it becomes the string "NaN" / "Infinity" / "-Infinity", so it still shows.
- The dashboard never writes the store. A `running` run (or eval) whose last
  sign of life is older than the heartbeat timeout is *shown* as `crashed`
  (`stale: true`), the rule `Store.mark_crashed` applies when `rollout runs
  list` stores it.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Sequence

from rollout.store.base import EvalRecord, EventRecord, MetricRecord, RunRecord, RunSummary, SnapshotRecord

# Statuses whose run stopped before its budget: `rollout train --resume` continues from its last train_state.
RESUMABLE_STATUSES = frozenset({"crashed", "failed", "cancelled"})
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "crashed"})
# What the runs table shows of each run's metrics (each at its own last step), in this order.
LISTED_METRICS = ("train/loss", "rollout/reward_mean", "train/accuracy", "eval/pass@1")
SNAPSHOT_ID_CHARS = 12  # as the CLI tables show them; any unique prefix of >= 8 is accepted


def jsonable(value: object) -> object:
    """`value` with every non-finite float replaced by its name, so strict JSON can carry it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def last_alive(record: RunRecord | EvalRecord) -> float:
    """The last sign of life: heartbeat, else start, else creation (as `Store.mark_crashed` reads it)."""
    for stamp in (record.heartbeat_at, record.started_at):
        if stamp is not None:
            return stamp
    return record.created_at


def is_stale(record: RunRecord | EvalRecord, *, now: float, timeout_s: float) -> bool:
    """A `running` record silent for longer than `timeout_s`: its process died without a last word."""
    return record.status == "running" and last_alive(record) < now - timeout_s


def describe_run(
    run: RunRecord, summary: RunSummary | None, *, now: float, timeout_s: float
) -> dict[str, object]:
    """One row of the runs table."""
    stale = is_stale(run, now=now, timeout_s=timeout_s)
    status = "crashed" if stale else run.status
    end = last_alive(run) if stale else run.ended_at
    duration = None
    if run.started_at is not None:
        duration = max(0.0, (end if end is not None else now) - run.started_at)
    latest = summary.latest if summary is not None else {}
    return {
        "id": run.id,
        "name": run.name,
        "algorithm": run.algorithm,
        "status": status,
        "stored_status": run.status,
        "crashed": status == "crashed",
        "stale": stale,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "ended_at": end,
        "heartbeat_at": run.heartbeat_at,
        "age_s": max(0.0, now - run.created_at),
        "duration_s": duration,
        "error": run.error if not stale else f"no heartbeat for {now - last_alive(run):.0f} s (process died?)",
        "resumed_from": run.resumed_from,
        "last_step": summary.last_step if summary is not None else None,
        "latest": {name: finite_or_none(latest[name]) for name in LISTED_METRICS if name in latest},
        "last_train_state_id": summary.last_train_state_id if summary is not None else None,
    }


def describe_run_detail(
    run: RunRecord,
    summary: RunSummary | None,
    final: dict[str, float],
    *,
    now: float,
    timeout_s: float,
) -> dict[str, object]:
    """The run page's header: the row, every metric's last value, and where a resume would start."""
    described = describe_run(run, summary, now=now, timeout_s=timeout_s)
    resume_from = described["last_train_state_id"] if described["status"] in RESUMABLE_STATUSES else None
    described.update(
        config_digest=run.config_digest,
        final_metrics={name: finite_or_none(value) for name, value in sorted(final.items())},
        metric_names=sorted(final),
        terminal=described["status"] in TERMINAL_STATUSES,
        resume_from=resume_from,
        resume_command=resume_command(run.algorithm, str(resume_from)) if resume_from else None,
    )
    return described


def resume_command(algorithm: str, snapshot_id: str) -> str:
    # The run's config file is not in the store: CONFIG stands for it (it also names the storage).
    return f"rollout train {algorithm} --config CONFIG --resume {snapshot_id[:SNAPSHOT_ID_CHARS]}"


def export_command(snapshot_id: str, storage_args: Sequence[str]) -> str:
    short = snapshot_id[:SNAPSHOT_ID_CHARS]
    return shlex.join(["rollout", "snapshot", "export", short, f"./export-{short}", *storage_args])


def describe_snapshot(
    record: SnapshotRecord, *, algorithm: str, storage_args: Sequence[str], now: float
) -> dict[str, object]:
    """One row of a run's snapshot table, with the commands to copy."""
    train_state = record.kind == "train_state"
    return {
        "id": record.id,
        "short_id": record.id[:SNAPSHOT_ID_CHARS],
        "kind": record.kind,
        "step": record.step,
        "label": record.label,
        "parent_id": record.parent_id,
        "created_at": record.created_at,
        "age_s": max(0.0, now - record.created_at),
        "size_bytes": sum(int(e.get("size", 0)) for e in record.manifest.get("blobs", {}).values()),
        "export_command": export_command(record.id, storage_args) if train_state else None,
        "resume_command": resume_command(algorithm, record.id) if train_state else None,
    }


def describe_event(event: EventRecord) -> dict[str, object]:
    return {"seq": event.seq, "time": event.time, "name": event.name, "fields": jsonable(event.fields)}


def describe_eval(record: EvalRecord, samples: int, *, now: float, timeout_s: float) -> dict[str, object]:
    """One row of an evals table; `metrics` is the finished eval's summary (empty before)."""
    stale = is_stale(record, now=now, timeout_s=timeout_s)
    summary = record.summary or {}
    return {
        "id": record.id,
        "name": record.name,
        "status": "crashed" if stale else record.status,
        "stale": stale,
        "model": record.model,
        "engine": record.engine,
        "env": record.env,
        "n_prompts": record.n_prompts,
        "n": record.n,
        "samples_stored": samples,
        "run_id": record.run_id,
        "step": record.step,
        "created_at": record.created_at,
        "age_s": max(0.0, now - record.created_at),
        "metrics": jsonable(summary.get("metrics", {})),
        "error": record.error,
    }


def metric_series(records: Iterable[MetricRecord], *, since: int = 0) -> dict[str, object]:
    """`{"series": {name: [[step, value], ...]}, "last_step": S}` for steps >= `since`, ordered by step.

    `since` is inclusive so a poller that asks from its last step again also gets the metrics
    of that step which landed after its previous poll (a step's metrics may come in parts).
    """
    series: dict[str, list[list[float | int | None]]] = {}
    last_step: int | None = None
    for record in records:
        if record.step < since:
            continue
        series.setdefault(record.name, []).append([record.step, finite_or_none(record.value)])
        last_step = record.step if last_step is None else max(last_step, record.step)
    for points in series.values():
        points.sort(key=lambda point: point[0])  # type: ignore[arg-type, return-value]
    return {"series": dict(sorted(series.items())), "last_step": last_step}
