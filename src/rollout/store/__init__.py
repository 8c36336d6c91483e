"""Storage: the metadata store (runs, events, metrics, snapshot rows) and the object store (blobs).

Builders turn config values into stores:

    store = open_store("embedded", path=Path("rollout.db"))
    objects = open_object_store("fs", path=Path("object-store"))
    objects = open_object_store("s3", path=Path("object-store"), url="s3://bucket/prefix", write_behind=True)

`SqlStore` (and SQLAlchemy) and the bucket clients (boto3) are imported lazily
so `import rollout.store` stays cheap.
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
from rollout.store.objects import BucketUrl, FsObjectStore, ObjectStore, parse_bucket_url

if TYPE_CHECKING:
    from rollout.store.gcs import GcsObjectStore
    from rollout.store.s3 import S3ObjectStore
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


def open_object_store(
    backend: Literal["fs", "s3", "gcs"],
    *,
    path: Path,
    url: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    max_attempts: int = 5,
    write_behind: bool = False,
) -> ObjectStore:
    """The blob store: `fs` is a directory tree at `path` (created); `s3` / `gcs` the bucket at `url`
    (`s3://bucket/prefix`, `gs://bucket/prefix`; credentials from the provider's usual chain),
    checked to exist. With `write_behind` (a training run), a
    bucket store's puts are staged under `path` and uploaded in the background (`WriteBehindObjectStore`)."""
    if backend == "fs":
        return FsObjectStore(Path(path).expanduser())
    if backend not in ("s3", "gcs"):
        raise StorageError(f"unknown object store backend {backend!r}; expected 'fs', 's3' or 'gcs'")
    if not url:
        raise StorageError(f"the {backend} object store needs a url (s3://bucket/prefix or gs://bucket/prefix)")
    try:
        location = parse_bucket_url(url)
    except ValueError as err:
        raise StorageError(f"object store url: {err}") from None
    if location.backend != backend:
        raise StorageError(f"object store url {url!r} does not match backend {backend!r}")
    remote = _open_bucket_store(location, endpoint_url=endpoint_url, region=region, max_attempts=max_attempts)
    remote.check_bucket()  # a wrong bucket or missing credentials fail here, not in the first upload
    if not write_behind:
        return remote
    from rollout.store.write_behind import WriteBehindObjectStore

    return WriteBehindObjectStore(remote, Path(path).expanduser())


def _open_bucket_store(
    location: BucketUrl, *, endpoint_url: str | None, region: str | None, max_attempts: int
) -> S3ObjectStore | GcsObjectStore:
    """`S3ObjectStore` or `GcsObjectStore`, their clients imported only now."""
    try:
        if location.backend == "s3":
            from rollout.store.s3 import S3ObjectStore

            return S3ObjectStore(
                location.bucket, location.prefix,
                endpoint_url=endpoint_url, region=region, max_attempts=max_attempts,
            )  # fmt: skip
        from rollout.store.gcs import GcsObjectStore

        return GcsObjectStore(location.bucket, location.prefix, endpoint_url=endpoint_url)
    except ImportError as err:
        raise StorageError(
            f"the {location.backend} object store needs {err.name}, which is not installed",
            details=[f"pip install 'rollout[{location.backend}]'"],
        ) from err


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
