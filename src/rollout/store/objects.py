"""Content-addressed blob storage: the `ObjectStore` interface and `FsObjectStore`.

A blob's name is the blake3 hex digest of its bytes, so a put is idempotent and
every read can be verified. `FsObjectStore` lays blobs out as `root/ab/cd/abcd…`
and never exposes a half-written file: bytes go to a temp file that is fsynced
and atomically renamed into place, then the directory is fsynced. The bucket
stores (`rollout.store.s3`, `rollout.store.gcs`) use the same layout under `bucket/prefix/`;
`parse_bucket_url` checks their `s3://bucket/prefix` URLs.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import blake3

from rollout.errors import BlobCorrupted, BlobNotFound, StorageError

_DIGEST = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_TMP_PREFIX = ".tmp-"
_BUCKET_SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> object store backend
_BUCKET_NAME = {
    "s3": re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
    "gs": re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]"),
}
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")
_KEY_SEGMENT = re.compile(r"[A-Za-z0-9._=+-]+")


class ObjectStore(Protocol):
    """Blobs keyed by the blake3 hex digest of their bytes."""

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; returns its digest (64 lowercase hex). Idempotent."""
        ...

    def put_file(self, path: Path) -> str:
        """Store a file's bytes (streamed); returns its digest."""
        ...

    def get_bytes(self, digest: str) -> bytes:
        """The verified bytes, or `BlobNotFound` / `BlobCorrupted`."""
        ...

    def get_file(self, digest: str, dest: Path) -> None:
        """Write the verified blob to `dest` (nothing is left at `dest` on a failed check)."""
        ...

    def exists(self, digest: str) -> bool: ...

    def delete(self, digest: str) -> None:
        """Remove a blob; a missing blob is not an error."""
        ...

    def iter_digests(self) -> Iterator[str]:
        """Every stored digest, sorted."""
        ...


def check_digest(digest: str) -> str:
    """`digest` if it is 64 lowercase hex chars, else StorageError (so it can never name a path)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise StorageError(f"invalid blob digest {digest!r}: expected 64 lowercase hex characters")
    return digest


@dataclass(frozen=True)
class BucketUrl:
    """Where a bucket store keeps its blobs: `scheme://bucket/prefix` (prefix may be empty)."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def backend(self) -> str:
        return _BUCKET_SCHEMES[self.scheme]

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


def parse_bucket_url(url: str) -> BucketUrl:
    """`s3://bucket/prefix` or `gs://bucket/prefix`, checked; ValueError says what is wrong.

    Bucket names follow the providers' rules (3-63 lowercase letters, digits, `.`
    and `-`, `_` too on GCS; no `..`, not an IP address); the prefix is `/`-separated
    segments of `A-Z a-z 0-9 . _ = + -`, none of them empty, `.` or `..`.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _BUCKET_SCHEMES:
        raise ValueError(f"must look like s3://bucket/prefix or gs://bucket/prefix (got {url!r})")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.removesuffix("/")
    if not _BUCKET_NAME[scheme].fullmatch(bucket) or ".." in bucket or _IP_ADDRESS.fullmatch(bucket):
        raise ValueError(
            f"bucket name {bucket!r} is invalid: 3-63 lowercase letters, digits, '.' and '-'"
            f"{' and _' if scheme == 'gs' else ''}, starting and ending with a letter or digit, no '..'"
        )
    for segment in prefix.split("/") if prefix else ():
        if segment in (".", "..") or not _KEY_SEGMENT.fullmatch(segment):
            raise ValueError(
                f"prefix {prefix!r} is invalid: '/'-separated names of letters, digits and '._=+-', "
                "none empty, '.' or '..'"
            )
    return BucketUrl(scheme, bucket, prefix)


def hash_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def hash_file(path: Path) -> str:
    """The blake3 hex digest of a file's bytes (memory-mapped, multithreaded); OSError if unreadable."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()


class FsObjectStore:
    """An `ObjectStore` in a local directory tree (`root/ab/cd/<digest>`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        with _os_errors(f"create the object store at {self.root}"):
            self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / digest[:2] / digest[2:4] / digest

    def put_bytes(self, data: bytes) -> str:
        digest = hash_bytes(data)
        final = self.path_for(digest)
        if final.exists():
            return digest
        with _os_errors(f"write blob {digest} under {self.root}"):
            _make_shard_dirs(final)
            with _temp_file(final.parent) as (tmp, handle):
                handle.write(data)
                _sync_and_close(handle)
                _install(tmp, final)
        return digest

    def put_file(self, path: Path) -> str:
        # One pass: hash while copying into a temp file under root, then rename into its shard.
        staging = self.root / ".tmp"
        with _os_errors(f"store file {path} under {self.root}"):
            staging.mkdir(exist_ok=True)
            with _temp_file(staging) as (tmp, handle), open(path, "rb") as source:
                hasher = blake3.blake3()
                while chunk := source.read(_CHUNK):
                    hasher.update(chunk)
                    handle.write(chunk)
                _sync_and_close(handle)
                digest = hasher.hexdigest()
                final = self.path_for(digest)
                if not final.exists():
                    _make_shard_dirs(final)
                    _install(tmp, final)
        return digest

    def get_bytes(self, digest: str) -> bytes:
        path = self.path_for(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(f"blob not found: {digest} (object store {self.root})") from None
        except OSError as err:
            raise StorageError(f"cannot read blob {digest} under {self.root}: {err}") from err
        actual = hash_bytes(data)
        if actual != digest:
            raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({path})")
        return data

    def get_file(self, digest: str, dest: Path) -> None:
        path = self.path_for(digest)
        dest = Path(dest)
        with _os_errors(f"copy blob {digest} to {dest}"):
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file():
                raise BlobNotFound(f"blob not found: {digest} (object store {self.root})")
            with open(path, "rb") as source, _temp_file(dest.parent) as (tmp, handle):
                hasher = blake3.blake3()
                while chunk := source.read(_CHUNK):
                    hasher.update(chunk)
                    handle.write(chunk)
                _sync_and_close(handle)
                actual = hasher.hexdigest()
                if actual != digest:
                    raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({path})")
                _install(tmp, dest)

    def exists(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    def delete(self, digest: str) -> None:
        path = self.path_for(digest)
        with _os_errors(f"delete blob {digest} under {self.root}"):
            path.unlink(missing_ok=True)

    def iter_digests(self) -> Iterator[str]:
        for first in sorted(self.root.glob("[0-9a-f][0-9a-f]")):
            for second in sorted(first.glob("[0-9a-f][0-9a-f]")):
                for blob in sorted(second.iterdir()):
                    name = blob.name
                    if _DIGEST.fullmatch(name) and name[:2] == first.name and name[2:4] == second.name:
                        yield name


@contextlib.contextmanager
def _temp_file(directory: Path) -> Iterator[tuple[Path, BinaryIO]]:
    """A temp file in `directory`; removed on exit unless it was renamed away."""
    fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=directory)
    tmp = Path(name)
    handle = os.fdopen(fd, "wb")
    try:
        yield tmp, handle
    finally:
        handle.close()
        tmp.unlink(missing_ok=True)


def _sync_and_close(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


def _install(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _make_shard_dirs(final: Path) -> None:
    """Create `ab/cd/` for a blob path, fsyncing each parent whose entries changed."""
    shard = final.parent
    for directory in (shard.parent, shard):
        if not directory.is_dir():
            directory.mkdir(exist_ok=True)
            _fsync_dir(directory.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _os_errors(action: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as err:
        raise StorageError(f"cannot {action}: {err.strerror or err}", details=[str(err)]) from err
