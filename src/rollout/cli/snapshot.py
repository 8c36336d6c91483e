"""`rollout snapshot list|show|prune|gc|export`, and the storage flags every store command shares.

    rollout snapshot list --storage-path rollout.db --run-id 01J… --kind train_state --limit 5
    rollout snapshot show 3f2a9c1e                # a table on a TTY, JSON when piped or with --json
    rollout snapshot prune --run-id 01J… --keep-last 3
    rollout snapshot gc
    rollout snapshot export 3f2a9c1e ./exported-model

Storage comes from, in order: `--dsn` (PostgreSQL) or `--storage-path`, then
`--config F`'s `[storage]` block, then `$ROLLOUT_STORAGE_PATH` /
`$ROLLOUT_OBJECT_PATH`, then `./rollout.db` and `./object-store`. These
commands never create a store: a missing SQLite file is an error. A bucket
object store (`[storage.objects] backend = "s3"` or `"gcs"`) comes from `--config`.

This module also holds the table helpers `rollout runs` shares: listings print
rich tables on a terminal and exactly the JSON shapes scripts rely on otherwise.

Only light imports at module level (SPEC section 2: `rollout --help` is instant): the
store, the config models and the snapshot helpers are imported inside the commands.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rollout.errors import StorageError

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from rollout.config import StorageConfig
    from rollout.store import ObjectStore, SnapshotRecord, Store

app = typer.Typer(help="Manage snapshots (list, show, prune, gc, export).", no_args_is_help=True)

DEFAULT_STORAGE_PATH = Path("rollout.db")
DEFAULT_OBJECT_PATH = Path("object-store")

StoragePathOption = Annotated[
    Path | None,
    typer.Option(
        "--storage-path", help="SQLite store file [default: $ROLLOUT_STORAGE_PATH or ./rollout.db]."
    ),
]
ObjectPathOption = Annotated[
    Path | None,
    typer.Option(
        "--object-path", help="Object store folder [default: $ROLLOUT_OBJECT_PATH or ./object-store]."
    ),
]
DsnOption = Annotated[
    str | None, typer.Option("--dsn", help="PostgreSQL DSN (postgresql://…); used instead of --storage-path.")
]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", help="Take storage settings from this run config (TOML).")
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print JSON (the default when stdout is not a terminal).")
]
SNAPSHOT_ID_CHARS = 12  # what tables show of a snapshot id; `show` takes any unique prefix of >= 8
RUN_ID_CHARS = 10  # what tables show of a run id: the ULID's time part; `runs show` takes it


@dataclass(frozen=True)
class StorageFlags:
    """The storage flags of one command invocation."""

    storage_path: Path | None = None
    object_path: Path | None = None
    dsn: str | None = None
    config: Path | None = None


@contextmanager
def open_metadata_store(flags: StorageFlags) -> Iterator[Store]:
    """The existing metadata store the flags point at (never creates one); closed on exit."""
    from rollout.store import open_store

    dsn, path = _resolve_metadata_location(flags)
    if dsn is not None:
        store = open_store("postgres", dsn=dsn)
    else:
        assert path is not None
        if not path.is_file():
            raise StorageError(f"no store at {path}", details=["pass --storage-path, --dsn or --config"])
        store = open_store("embedded", path=path)
    try:
        yield store
    finally:
        store.close()


def open_existing_object_store(flags: StorageFlags) -> ObjectStore:
    """The existing object store the flags point at (never creates one): a folder, or the config's
    s3 / gcs bucket (credentials from the provider's usual chain)."""
    from rollout.store import open_object_store

    if flags.object_path is not None:
        path = flags.object_path
    elif flags.config is not None:
        objects = _load_storage_config(flags.config).objects
        if objects.backend != "fs":  # a bucket: opening it checks that it exists
            return open_object_store(
                objects.backend, path=objects.path, url=objects.url, endpoint_url=objects.endpoint_url,
                region=objects.region, max_attempts=objects.max_attempts,
            )
        path = objects.path
    else:
        path = Path(os.environ.get("ROLLOUT_OBJECT_PATH") or DEFAULT_OBJECT_PATH)
    if not path.is_dir():
        raise StorageError(f"no object store at {path}", details=["pass --object-path or --config"])
    return open_object_store("fs", path=path)


def print_json(value: object) -> None:
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


def wants_json(as_json: bool) -> bool:
    """JSON with `--json` or when stdout is not a terminal (a pipe, a file): scripts get stable shapes."""
    return as_json or not sys.stdout.isatty()


# --------------------------------------------------------------------------- tables


def print_tables(*tables: Table) -> None:
    from rich.console import Console

    # Not a terminal (a log, `--table` into a pipe): wide enough that no column is squashed.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    for table in tables:
        console.print(table)


def new_table(*columns: str, title: str | None = None) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(*columns, box=box.SIMPLE_HEAD, title=title, title_justify="left", title_style="bold")
    return table


def key_value_table(rows: Sequence[tuple[str, str | Text]], *, title: str | None = None) -> Table:
    table = new_table("field", "value", title=title)
    table.columns[0].style = "bold"
    table.columns[0].no_wrap = True
    table.columns[1].overflow = "fold"
    for key, value in rows:
        table.add_row(key, plain(value) if isinstance(value, str) else value)
    return table


def plain(value: object, style: str = "") -> Text:
    """A cell shown as is: names, errors and labels may hold `[...]`, which rich would read as markup."""
    from rich.text import Text

    return Text("" if value is None else str(value), style=style)


def format_age(timestamp: float | None, *, now: float | None = None) -> str:
    """How long ago, coarsely: "12s ago", "3m ago", "5h ago", "4d ago"."""
    if timestamp is None:
        return ""
    seconds = max(0, int((time.time() if now is None else now) - timestamp))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit == "d" else 1):
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def format_time(timestamp: float | None) -> str:
    from datetime import datetime

    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def format_bytes(size: int) -> str:
    """1023 B, 1.5 KiB, 12.0 MiB, ..."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def snapshot_size(record: SnapshotRecord) -> int:
    """Bytes of the snapshot's blobs, from its manifest (shared blobs counted in each snapshot)."""
    return sum(int(entry.get("size", 0)) for entry in record.manifest.get("blobs", {}).values())


def snapshots_table(records: Sequence[SnapshotRecord], *, with_run: bool, title: str | None = None) -> Table:
    """id prefix, kind, [run prefix,] step, label, age, size: one row per snapshot."""
    columns = ["id", "kind", *(["run"] if with_run else []), "step", "label", "age", "size"]
    table = new_table(*columns, title=title)
    for column in table.columns:
        column.no_wrap = column.header != "label"
    for name in ("step", "size"):
        table.columns[columns.index(name)].justify = "right"
    now = time.time()
    for r in records:
        run = [r.run_id[:RUN_ID_CHARS]] if with_run else []
        table.add_row(
            r.id[:SNAPSHOT_ID_CHARS], r.kind, *run, str(r.step), plain(r.label),
            format_age(r.created_at, now=now), format_bytes(snapshot_size(r)),
        )  # fmt: skip
    return table


def describe_snapshot(record: SnapshotRecord, *, with_manifest: bool) -> dict:
    described = asdict(record)
    if not with_manifest:
        del described["manifest"]
    return described


@app.command("list")
def list_command(
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Only this run's snapshots.")] = None,
    kind: Annotated[
        str | None, typer.Option("--kind", help="train_state | buffer | episodic_memory | process")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List snapshots, newest first: a table on a terminal, else a JSON array (manifests omitted; see `show`)."""
    flags = StorageFlags(storage_path, object_path, dsn, config)
    with open_metadata_store(flags) as store:
        records = store.list_snapshots(run_id=run_id, kind=kind, limit=limit)
    if wants_json(as_json):
        print_json([describe_snapshot(r, with_manifest=False) for r in records])
    else:
        print_tables(snapshots_table(records, with_run=True))


@app.command("show")
def show_command(
    snapshot_id: Annotated[
        str, typer.Argument(metavar="ID", help="Snapshot id or a unique prefix (>= 8 hex).")
    ],
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show one snapshot, manifest included: tables on a terminal, else JSON."""
    with open_metadata_store(StorageFlags(storage_path, object_path, dsn, config)) as store:
        record = store.get_snapshot(snapshot_id)
    if wants_json(as_json):
        print_json(describe_snapshot(record, with_manifest=True))
    else:
        print_tables(*_snapshot_tables(record))


@app.command("prune")
def prune_command(
    run_id: Annotated[str, typer.Option("--run-id", help="The run whose snapshots to prune.")],
    keep_last: Annotated[
        int, typer.Option("--keep-last", min=0, help="Keep this many newest steps per kind.")
    ] = 3,
    keep_labeled: Annotated[
        bool, typer.Option("--keep-labeled/--no-keep-labeled", help="Also keep labeled snapshots.")
    ] = True,
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Delete a run's older snapshot rows (blobs go with `snapshot gc`)."""
    from rollout.snapshots import prune_snapshots

    with open_metadata_store(StorageFlags(storage_path, object_path, dsn, config)) as store:
        pruned = prune_snapshots(store, run_id=run_id, keep_last=keep_last, keep_labeled=keep_labeled)
    typer.echo(f"pruned {pruned} snapshots")


@app.command("gc")
def gc_command(
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Delete blobs that no snapshot references (don't run it while a run is saving a snapshot)."""
    from rollout.snapshots import collect_garbage

    flags = StorageFlags(storage_path, object_path, dsn, config)
    objects = open_existing_object_store(flags)
    with open_metadata_store(flags) as store:
        deleted = collect_garbage(store, objects)
    typer.echo(f"deleted {deleted} blobs")


@app.command("export")
def export_command(
    snapshot_id: Annotated[
        str, typer.Argument(metavar="ID", help="Snapshot id or a unique prefix (>= 8 hex).")
    ],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Where to write the model directory.")],
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Write a train_state snapshot as a Hugging Face-loadable model directory."""
    from rollout.export import export_snapshot

    flags = StorageFlags(storage_path, object_path, dsn, config)
    with open_metadata_store(flags) as store:
        record = store.get_snapshot(snapshot_id)
        objects = open_existing_object_store(flags)
        export_snapshot(store, objects, record, Path(out_dir))
    typer.echo(str(out_dir))


def _snapshot_tables(record: SnapshotRecord) -> list[Table]:
    """The record as key/value rows, then one row per blob (digest prefix, size, its other manifest keys)."""
    shown = {"blobs", "kind", "run_id", "step", "label", "parent_id"}  # blobs below, the rest above
    extra = {k: v for k, v in record.manifest.items() if k not in shown}
    fields = [
        ("id", record.id),
        ("kind", record.kind),
        ("run", record.run_id),
        ("step", str(record.step)),
        ("label", record.label or ""),
        ("parent", record.parent_id or ""),
        ("created", f"{format_time(record.created_at)} ({format_age(record.created_at)})"),
        ("size", format_bytes(snapshot_size(record))),
        ("manifest", json.dumps(extra, sort_keys=True, ensure_ascii=False)),
        ("metadata", json.dumps(record.metadata, sort_keys=True, ensure_ascii=False)),
    ]
    blobs = new_table("blob", "digest", "size", "details", title="blobs")
    blobs.columns[2].justify = "right"
    for name, entry in sorted(record.manifest.get("blobs", {}).items()):
        blobs.add_row(
            plain(name),
            str(entry.get("digest", ""))[:SNAPSHOT_ID_CHARS],
            format_bytes(int(entry.get("size", 0))),
            plain(_blob_details(entry)),
        )
    return [key_value_table(fields, title=f"snapshot {record.id[:SNAPSHOT_ID_CHARS]}"), blobs]


def _blob_details(entry: dict) -> str:
    """A blob's manifest keys besides digest/size, short: `tensors` (one entry per tensor) as a count and dtypes."""
    parts = []
    for key, value in sorted(entry.items()):
        if key in ("digest", "size"):
            continue
        if key == "tensors" and isinstance(value, dict):
            dtypes = sorted({str(t.get("dtype")) for t in value.values() if isinstance(t, dict)})
            parts.append(f"{len(value)} tensors ({', '.join(dtypes)})" if dtypes else f"{len(value)} tensors")
        elif isinstance(value, dict | list):
            parts.append(f"{key}=<{len(value)} items>")
        else:
            parts.append(f"{key}={json.dumps(value, ensure_ascii=False)}")
    return " ".join(parts)


def _resolve_metadata_location(flags: StorageFlags) -> tuple[str | None, Path | None]:
    """(dsn, None) for PostgreSQL or (None, sqlite_path) for the embedded store."""
    if flags.dsn:
        return flags.dsn, None
    if flags.storage_path is not None:
        return None, flags.storage_path
    if flags.config is not None:
        storage = _load_storage_config(flags.config)
        if storage.backend == "postgres":
            return storage.postgres.dsn, None
        return None, storage.embedded.path
    return None, Path(os.environ.get("ROLLOUT_STORAGE_PATH") or DEFAULT_STORAGE_PATH)


def _load_storage_config(config: Path) -> StorageConfig:
    from rollout.config import load_config

    return load_config(Path(config)).storage
