"""`rollout runs list|show` and `rollout logs tail`.

    rollout runs list --status running            # a table on a TTY, JSON otherwise (or with --json)
    rollout runs show 01J8ABCDEF                  # record + final metrics + snapshots (id or >= 10-char prefix)
    rollout logs tail 01J8… --follow              # events as JSON lines until the run ends

A run killed without a last word (SIGKILL, power loss) stops its heartbeat
(`rollout.observe.Heartbeat`). These commands first mark every `running` run
whose heartbeat is older than `--heartbeat-timeout` (default
`$ROLLOUT_HEARTBEAT_TIMEOUT`, else 60 s) as `crashed`, so the store says so
from then on; `runs show` of a crashed, failed or cancelled run gives the
snapshot to `rollout train ... --resume` from as `resume_from`.

Storage flags as in `rollout snapshot` (see `rollout.cli.snapshot`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from rollout.cli.snapshot import (
    RUN_ID_CHARS,
    SNAPSHOT_ID_CHARS,
    ConfigOption,
    DsnOption,
    JsonOption,
    StorageFlags,
    StoragePathOption,
    format_age,
    format_time,
    key_value_table,
    new_table,
    open_metadata_store,
    plain,
    print_json,
    print_tables,
    snapshots_table,
    wants_json,
)

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from rollout.store import EventRecord, RunRecord, RunSummary, SnapshotRecord, Store

runs_app = typer.Typer(help="Runs with status, timings and final metrics.", no_args_is_help=True)
logs_app = typer.Typer(help="A run's structured events.", no_args_is_help=True)

_TAIL_PAGE = 1000
# Statuses whose run stopped before its budget: `rollout train --resume` continues from its last train_state.
RESUMABLE_STATUSES = frozenset({"crashed", "failed", "cancelled"})
# The metric a listing shows per run: the first of these the run logged (RL reward, else the loss).
KEY_METRICS = (("rollout/reward_mean", "reward"), ("train/loss", "loss"))
_STATUS_STYLES = {
    "pending": "dim",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
    "crashed": "bold white on red",
}

HeartbeatTimeoutOption = Annotated[
    float,
    typer.Option(
        "--heartbeat-timeout",
        envvar="ROLLOUT_HEARTBEAT_TIMEOUT",
        min=0.1,
        metavar="SECONDS",
        help="Mark running runs with no heartbeat for this long as crashed first (keep it well above"
        " the trainers' $ROLLOUT_HEARTBEAT_S, 5 s by default).",
    ),
]
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0


@runs_app.command("list")
def list_command(
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many runs.")] = None,
    status: Annotated[
        str | None,
        typer.Option("--status", help="pending | running | succeeded | failed | cancelled | crashed"),
    ] = None,
    as_json: JsonOption = False,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    storage_path: StoragePathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """List runs, newest first: a table on a terminal, else a JSON array (config_json omitted)."""
    with open_metadata_store(StorageFlags(storage_path=storage_path, dsn=dsn, config=config)) as store:
        store.mark_crashed(timeout_s=heartbeat_timeout)
        runs = store.list_runs(limit=limit, status=status)
        as_table = not wants_json(as_json)
        # Batched: every run's last step, key metric and last train_state in a fixed number of queries.
        names = [name for name, _ in KEY_METRICS]
        summaries = store.summarize_runs([r.id for r in runs], metric_names=names) if as_table else {}
    if as_table:
        print_tables(_runs_table(runs, summaries))
    else:
        print_json([_describe_run(run) for run in runs])


@runs_app.command("show")
def show_command(
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID", help="Run id or a unique prefix (>= 10 chars).")],
    as_json: JsonOption = False,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    storage_path: StoragePathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Show a run's record, final metrics and snapshots: tables on a terminal, else JSON."""
    with open_metadata_store(StorageFlags(storage_path=storage_path, dsn=dsn, config=config)) as store:
        store.mark_crashed(timeout_s=heartbeat_timeout)
        run = store.get_run(run_id)
        final = store.final_metrics(run.id)
        snapshots = store.list_snapshots(run_id=run.id)
    # Newest first, so the first train_state is where a resume starts.
    resume_from = next((s.id for s in snapshots if s.kind == "train_state"), None)
    if run.status not in RESUMABLE_STATUSES:
        resume_from = None
    if wants_json(as_json):
        print_json(
            {
                **asdict(run),
                "final_metrics": final,
                "snapshot_count": len(snapshots),
                "snapshot_ids": [s.id for s in snapshots],
                "resume_from": resume_from,
            }
        )
    else:
        print_tables(*_run_tables(run, final, snapshots, resume_from))


@logs_app.command("tail")
def tail_command(
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events until the run ends.")
    ] = False,
    since_seq: Annotated[
        int, typer.Option("--since-seq", min=0, help="Start at this event seq (inclusive).")
    ] = 0,
    interval: Annotated[float, typer.Option("--interval", min=0.01, help="Seconds between polls.")] = 0.5,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    storage_path: StoragePathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Print a run's events as JSON lines (the same shape as the run's events.jsonl)."""
    from rollout.store import TERMINAL_RUN_STATUSES

    with (
        open_metadata_store(StorageFlags(storage_path=storage_path, dsn=dsn, config=config)) as store,
        _quiet_on_closed_pipe(),
    ):
        run_id = store.get_run(run_id).id  # RunNotFound before anything else; a prefix becomes the id
        last_seq = _print_events(store, run_id, after_seq=since_seq - 1)
        while follow:
            # A run whose process died never ends by itself: notice it here too (--heartbeat-timeout).
            store.mark_crashed(timeout_s=heartbeat_timeout)
            # Read the status before the events: once it is terminal, this drain is the last one.
            finished = store.get_run(run_id).status in TERMINAL_RUN_STATUSES
            last_seq = _print_events(store, run_id, after_seq=last_seq)
            if finished:
                break
            time.sleep(interval)


@contextmanager
def _quiet_on_closed_pipe() -> Iterator[None]:
    """`rollout logs tail RUN | head` ends quietly when the reader goes away."""
    try:
        yield
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush doesn't fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None


def _print_events(store: Store, run_id: str, *, after_seq: int) -> int:
    """Print every event after `after_seq`; returns the last seq printed (or `after_seq`)."""
    while page := store.read_events(run_id, after_seq=after_seq, limit=_TAIL_PAGE):
        for event in page:
            sys.stdout.write(_event_line(event))
        sys.stdout.flush()
        after_seq = page[-1].seq
    return after_seq


def _event_line(event: EventRecord) -> str:
    line = {
        "type": "event",
        "run_id": event.run_id,
        "seq": event.seq,
        "time": event.time,
        "name": event.name,
        "fields": event.fields,
    }
    return json.dumps(line, ensure_ascii=False) + "\n"


def _describe_run(run: RunRecord) -> dict:
    described = asdict(run)
    del described["config_json"]  # large; `runs show` has it
    return described


# --------------------------------------------------------------------------- tables


def _runs_table(runs: list[RunRecord], summaries: dict[str, RunSummary]) -> Table:
    """One row per run; ids are shown by their 10-char time prefix, which `runs show` accepts."""
    columns = ["id", "name", "algorithm", "status", "step", "age", "duration", "metric", "resume"]
    table = new_table(*columns)
    for column in table.columns:
        column.no_wrap = column.header != "name"
    for name in ("step", "duration"):
        table.columns[columns.index(name)].justify = "right"
    now = time.time()
    for run in runs:
        summary = summaries.get(run.id)
        step = "" if summary is None or summary.last_step is None else str(summary.last_step)
        resume = ""
        if run.status in RESUMABLE_STATUSES and summary is not None and summary.last_train_state_id:
            resume = summary.last_train_state_id[:SNAPSHOT_ID_CHARS]
        table.add_row(
            run.id[:RUN_ID_CHARS], plain(run.name), run.algorithm, _status_cell(run.status), step,
            format_age(run.created_at, now=now), _format_duration(run, now=now),
            _key_metric(summary.latest if summary else {}), resume,
        )  # fmt: skip
    return table


def _run_tables(
    run: RunRecord, final: dict[str, float], snapshots: list[SnapshotRecord], resume_from: str | None
) -> list[Table]:
    """The record as key/value rows, then the final metrics, then the run's snapshots."""
    fields: list[tuple[str, str | Text]] = [
        ("id", run.id),
        ("name", run.name or ""),
        ("algorithm", run.algorithm),
        ("status", _status_cell(run.status)),
        ("created", f"{format_time(run.created_at)} ({format_age(run.created_at)})"),
        ("started", format_time(run.started_at)),
        ("ended", format_time(run.ended_at)),
        ("duration", _format_duration(run)),
    ]
    if run.status in ("running", "crashed") and run.heartbeat_at is not None:
        fields.append(("heartbeat", f"{format_time(run.heartbeat_at)} ({format_age(run.heartbeat_at)})"))
    if run.error:
        fields.append(("error", run.error))
    if run.resumed_from:
        fields.append(("resumed from", run.resumed_from))
    if run.status in RESUMABLE_STATUSES:
        fields.append(("resume from", resume_from or "no train_state snapshot"))
        if resume_from:
            command = (
                f"rollout train {run.algorithm} --config CONFIG --resume {resume_from[:SNAPSHOT_ID_CHARS]}"
            )
            fields.append(("resume with", command))
    fields.append(("config digest", run.config_digest))
    tables = [key_value_table(fields, title=f"run {run.id}")]
    metrics = new_table("metric", "value", title="final metrics")
    metrics.columns[1].justify = "right"
    for name, value in sorted(final.items()):
        metrics.add_row(name, _format_number(value))
    tables.append(metrics)
    tables.append(snapshots_table(snapshots, with_run=False, title=f"snapshots ({len(snapshots)})"))
    return tables


def _status_cell(status: str) -> Text:
    return plain(status, style=_STATUS_STYLES.get(status, ""))


def _key_metric(latest: dict[str, float]) -> str:
    """ "loss 0.1234": the first of KEY_METRICS the run logged, at its last step."""
    for name, label in KEY_METRICS:
        if name in latest:
            return f"{label} {_format_number(latest[name])}"
    return ""


def _format_number(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"


def _format_duration(run: RunRecord, *, now: float | None = None) -> str:
    if run.started_at is None:
        return ""
    end = run.ended_at if run.ended_at is not None else (time.time() if now is None else now)
    seconds = max(0, int(end - run.started_at))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
