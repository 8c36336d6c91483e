"""`rollout snapshot list|show|prune|gc|export`, and the storage flags every store command shares.

    rollout snapshot list --storage-path rollout.db --run-id 01J… --kind train_state --limit 5
    rollout snapshot show 3f2a9c1e
    rollout snapshot prune --run-id 01J… --keep-last 3
    rollout snapshot gc
    rollout snapshot export 3f2a9c1e ./exported-model

Storage comes from, in order: `--dsn` (PostgreSQL) or `--storage-path`, then
`--config F`'s `[storage]` block, then `$ROLLOUT_STORAGE_PATH` /
`$ROLLOUT_OBJECT_PATH`, then `./rollout.db` and `./object-store`. These
commands never create a store: a missing SQLite file is an error.

Only light imports at module level (SPEC section 2: `rollout --help` is instant).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rollout.errors import StorageError

if TYPE_CHECKING:
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
    """The existing object store the flags point at (never creates one)."""
    from rollout.store import open_object_store

    if flags.object_path is not None:
        path = flags.object_path
    elif flags.config is not None:
        path = _load_storage_config(flags.config).objects.path
    else:
        path = Path(os.environ.get("ROLLOUT_OBJECT_PATH") or DEFAULT_OBJECT_PATH)
    if not path.is_dir():
        raise StorageError(f"no object store at {path}", details=["pass --object-path or --config"])
    return open_object_store("fs", path=path)


def print_json(value: object) -> None:
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


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
) -> None:
    """Print snapshots as a JSON array, newest first (manifests omitted; see `show`)."""
    flags = StorageFlags(storage_path, object_path, dsn, config)
    with open_metadata_store(flags) as store:
        records = store.list_snapshots(run_id=run_id, kind=kind, limit=limit)
    print_json([describe_snapshot(r, with_manifest=False) for r in records])


@app.command("show")
def show_command(
    snapshot_id: Annotated[
        str, typer.Argument(metavar="ID", help="Snapshot id or a unique prefix (>= 8 hex).")
    ],
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
    dsn: DsnOption = None,
    config: ConfigOption = None,
) -> None:
    """Print one snapshot, manifest included, as JSON."""
    with open_metadata_store(StorageFlags(storage_path, object_path, dsn, config)) as store:
        record = store.get_snapshot(snapshot_id)
    print_json(describe_snapshot(record, with_manifest=True))


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
