"""Storage: the metadata store (runs, events, metrics, snapshot rows) and the object store (blobs).

Builders turn config values into stores:

    store = open_store("embedded", path=Path("rollout.db"))
    objects = open_object_store("fs", path=Path("object-store"))

`SqlStore` (and SQLAlchemy) are imported lazily so `import rollout.store` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollout.errors import StorageError
from rollout.store.base import (
    RUN_STATUSES,
    TERMINAL_RUN_STATUSES,
    EventRecord,
    MetricRecord,
    RunRecord,
    RunStatus,
    RunSummary,
    SnapshotRecord,
    Store,
)
from rollout.store.objects import FsObjectStore, ObjectStore

if TYPE_CHECKING:
    from rollout.store.sql import SqlStore


def open_store(
    backend: Literal["embedded", "postgres"], *, path: Path | None = None, dsn: str | None = None
) -> Store:
    """The metadata store: `embedded` is a SQLite file at `path` (parent dir created), `postgres` uses `dsn`."""
    from rollout.store import sql

    if backend == "embedded":
        if path is None:
            raise StorageError("the embedded store needs a path")
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(f"cannot create the directory for the store at {path}: {err}") from err
        return sql.open_sqlite(path)
    if backend == "postgres":
        if not dsn:
            raise StorageError("the postgres store needs a dsn (postgresql://user@host:port/db)")
        return sql.open_postgres(dsn)
    raise StorageError(f"unknown store backend {backend!r}; expected 'embedded' or 'postgres'")


def open_object_store(backend: Literal["fs"], *, path: Path) -> ObjectStore:
    """The blob store: `fs` is a directory tree at `path` (created). `s3` / `gcs` are not built yet."""
    if backend == "fs":
        return FsObjectStore(Path(path).expanduser())
    if backend in ("s3", "gcs"):
        raise StorageError(f"object store backend {backend!r} is not supported yet; use 'fs'")
    raise StorageError(f"unknown object store backend {backend!r}; expected 'fs'")


def __getattr__(name: str) -> object:
    if name == "SqlStore":
        from rollout.store.sql import SqlStore

        return SqlStore
    raise AttributeError(f"module 'rollout.store' has no attribute {name!r}")


__all__ = [
    "RUN_STATUSES",
    "TERMINAL_RUN_STATUSES",
    "EventRecord",
    "FsObjectStore",
    "MetricRecord",
    "ObjectStore",
    "RunRecord",
    "RunStatus",
    "RunSummary",
    "SnapshotRecord",
    "SqlStore",
    "Store",
    "open_object_store",
    "open_store",
]
