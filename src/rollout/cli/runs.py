"""`rollout runs list|show` and `rollout logs tail`.

    rollout runs list --status running            # a table on a TTY, JSON otherwise (or with --json)
    rollout runs show 01J8…                       # record + final metrics + snapshots, as JSON
    rollout logs tail 01J8… --follow              # events as JSON lines until the run ends

Storage flags as in `rollout snapshot` (see `rollout.cli.snapshot`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from rollout.cli.snapshot import (
    ConfigOption,
    DsnOption,
    StorageFlags,
    StoragePathOption,
    open_metadata_store,
    print_json,
)

if TYPE_CHECKING:
    from rollout.store import EventRecord, RunRecord, Store

runs_app = typer.Typer(help="Runs with status, timings and final metrics.", no_args_is_help=True)
logs_app = typer.Typer(help="A run's structured events.", no_args_is_help=True)

_TAIL_PAGE = 1000


@runs_app.command("list")
def list_command(
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many runs.")] = None,
    status: Annotated[
        str | None, typer.Option("--status", help="pending | running | succeeded | failed | cancelled")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (the default when stdout is not a terminal).")
    ] = False,
    storage_path: StoragePathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """List runs, newest first."""
    with open_metadata_store(StorageFlags(storage_path=storage_path, dsn=dsn, config=config)) as store:
        runs = store.list_runs(limit=limit, status=status)
    if as_json or not sys.stdout.isatty():
        print_json([_describe_run(run) for run in runs])
    else:
        _print_runs_table(runs)


@runs_app.command("show")
def show_command(
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID")],
    storage_path: StoragePathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Print a run's record, final metrics and snapshot ids as JSON."""
    with open_metadata_store(StorageFlags(storage_path=storage_path, dsn=dsn, config=config)) as store:
        run = store.get_run(run_id)
        final = store.final_metrics(run_id)
        snapshots = store.list_snapshots(run_id=run_id)
    print_json(
        {
            **asdict(run),
            "final_metrics": final,
            "snapshot_count": len(snapshots),
            "snapshot_ids": [s.id for s in snapshots],
        }
    )


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
        store.get_run(run_id)  # RunNotFound before anything else
        last_seq = _print_events(store, run_id, after_seq=since_seq - 1)
        while follow:
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


def _print_runs_table(runs: list[RunRecord]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True, min_width=26)  # ids stay whole so they can be copied
    table.add_column("name", overflow="fold", min_width=6)
    for column in ("algorithm", "status", "created", "duration"):
        table.add_column(column, no_wrap=True)
    for run in runs:
        created = datetime.fromtimestamp(run.created_at).strftime("%Y-%m-%d %H:%M")
        table.add_row(run.id, run.name or "", run.algorithm, run.status, created, _format_duration(run))
    Console().print(table)


def _format_duration(run: RunRecord) -> str:
    if run.started_at is None:
        return ""
    seconds = int((run.ended_at or time.time()) - run.started_at)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
