"""Write-behind uploads: a training run never waits for the object store's network.

    objects = WriteBehindObjectStore(S3ObjectStore("bucket", "prefix"), Path("object-store"))
    digest = objects.put_bytes(data)                  # fsynced in a local staging folder; returns at once
    objects.commit_when_durable([digest], add_row)    # add_row() runs once the blob is in the bucket
    objects.close()                                   # every upload and row done (or the first error raised)

A put lands in a local `FsObjectStore` (this process's own staging folder under
`staging_root`) and is queued for upload; one background thread works the
queue in order: uploads, then the snapshot rows waiting on them. A row is
therefore written only after every blob it names is durable in the remote
store, and rows land in the order they were committed (a parent before its
child). Once a blob is up, its staged copy goes.

A crash leaves a staging folder that no live process owns (each folder is
held by an `flock` on its `.lock` file, which the kernel releases when the
process dies). The next store opened on the same `staging_root` discards it:
no row can name those blobs (rows wait for uploads), so finishing the upload
would only make garbage. An upload that fails (after the remote store's own
retries) stops the queue: later commits are not written, and the error is
raised by the next put, commit, `flush` or `close`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rollout.errors import BlobNotFound, StorageError
from rollout.progress import ByteProgress
from rollout.store.objects import FsObjectStore, ObjectStore, hash_bytes

_LOCK_SUFFIX = ".lock"


@dataclass(frozen=True)
class _Upload:
    digest: str


@dataclass(frozen=True)
class _Commit:
    digests: tuple[str, ...]
    commit: Callable[[], None]


@dataclass(frozen=True)
class _Barrier:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


class WriteBehindObjectStore:
    """An `ObjectStore` whose puts return once staged locally; `remote` gets the blobs in the background."""

    def __init__(self, remote: ObjectStore, staging_root: Path) -> None:
        self.remote = remote
        self.staging_root = Path(staging_root)
        try:
            self.staging_root.mkdir(parents=True, exist_ok=True)
            self.discarded = discard_abandoned_staging(self.staging_root)
            self._lock_path, self._lock_handle = _claim_staging_folder(self.staging_root)
        except OSError as err:
            raise StorageError(f"cannot prepare the staging folder {self.staging_root}: {err}") from err
        self.local = FsObjectStore(self._lock_path.with_suffix(""))
        self._lock = threading.Lock()
        self._staged: set[str] = set()  # queued for upload, not up yet
        self._uploaded: set[str] = set()  # in the remote store (put through this store)
        self._failure: StorageError | None = None
        self._failure_raised = False
        self._closed = False
        self._jobs: queue.Queue[object] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="object-upload", daemon=True)
        self._worker.start()

    # -- writes: staged now, uploaded later ------------------------------------

    def put_bytes(self, data: bytes) -> str:
        self._check_usable()
        digest = hash_bytes(data)
        with self._lock:
            if digest in self._uploaded or digest in self._staged:
                return digest
        self.local.put_bytes(data)
        return self._queue_upload(digest)

    def put_file(self, path: Path) -> str:
        self._check_usable()
        return self._queue_upload(self.local.put_file(path))

    def commit_when_durable(self, digests: Iterable[str], commit: Callable[[], None]) -> None:
        """Run `commit` on the upload thread once every blob in `digests` is in the remote store
        (blobs put earlier are queued ahead of it); never if one of their uploads fails."""
        with self._lock:
            self._check_usable()
            self._jobs.put(_Commit(tuple(digests), commit))

    def flush(self) -> None:
        """Block until every upload and commit queued so far is done; raises a background failure."""
        with self._lock:
            self._check_usable()
            barrier = _Barrier()
            self._jobs.put(barrier)
        barrier.done.wait()
        self._raise_failure()

    def close(self) -> None:
        """Finish the queue, stop the upload thread and remove this process's staging folder.

        Raises the first background failure (once); closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_STOP)
        self._wait_for_uploads()
        shutil.rmtree(self.local.root, ignore_errors=True)
        self._lock_path.unlink(missing_ok=True)
        self._lock_handle.close()  # releases the flock
        if not self._failure_raised:
            self._raise_failure()

    def _wait_for_uploads(self) -> None:
        """Join the upload thread, showing how many of the staged bytes are up (`ByteProgress`)."""
        total = self._staged_bytes()
        where = getattr(self.remote, "location", type(self.remote).__name__)
        with ByteProgress("upload", where, total) as progress:
            while self._worker.is_alive():
                self._worker.join(timeout=0.5)
                progress.update(total - self._staged_bytes())

    def _staged_bytes(self) -> int:
        with self._lock:
            staged = list(self._staged)
        size = 0
        for digest in staged:
            with contextlib.suppress(FileNotFoundError):  # uploaded and deleted meanwhile
                size += self.local.path_for(digest).stat().st_size
        return size

    # -- reads: the staged copy while there is one, else the remote store -----

    def get_bytes(self, digest: str) -> bytes:
        try:
            return self.local.get_bytes(digest)
        except BlobNotFound:
            return self.remote.get_bytes(digest)

    def get_file(self, digest: str, dest: Path) -> None:
        try:
            self.local.get_file(digest, dest)
        except BlobNotFound:
            self.remote.get_file(digest, dest)

    def exists(self, digest: str) -> bool:
        return self.local.exists(digest) or self.remote.exists(digest)

    def delete(self, digest: str) -> None:
        self.remote.delete(digest)
        self.local.delete(digest)

    def iter_digests(self) -> Iterator[str]:
        yield from sorted(set(self.remote.iter_digests()) | set(self.local.iter_digests()))

    # -- the upload thread ------------------------------------------------------

    def _queue_upload(self, digest: str) -> str:
        with self._lock:
            if digest not in self._staged and digest not in self._uploaded:
                self._staged.add(digest)
                self._jobs.put(_Upload(digest))
        return digest

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            if isinstance(job, _Barrier):
                job.done.set()
                continue
            if self._failure is not None:
                continue  # the queue stopped at the first failure: nothing after it is written
            try:
                if isinstance(job, _Upload):
                    self._upload(job.digest)
                elif isinstance(job, _Commit):
                    self._commit(job)
            except StorageError as err:
                self._failure = err
            except Exception as err:  # a bug or an unexpected client error: still surfaced to the caller
                self._failure = StorageError(f"background upload to the object store failed: {err!r}")

    def _upload(self, digest: str) -> None:
        staged = self.local.path_for(digest)
        if not staged.is_file():
            raise StorageError(f"staged blob {digest} vanished from {self.local.root} before its upload")
        uploaded = self.remote.put_file(staged)
        if uploaded != digest:
            raise StorageError(f"staged blob {digest} changed on disk before its upload (it hashes to {uploaded})")
        with self._lock:
            self._staged.discard(digest)
            self._uploaded.add(digest)
        self.local.delete(digest)

    def _commit(self, job: _Commit) -> None:
        for digest in job.digests:
            if digest not in self._uploaded and not self.remote.exists(digest):
                raise StorageError(f"cannot commit: blob {digest} is not in the object store")
        job.commit()

    def _check_usable(self) -> None:
        if self._closed:
            raise StorageError("the write-behind object store is closed")
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure


def finish_uploads(objects: ObjectStore) -> None:
    """Wait for a write-behind store's uploads and pending snapshot rows and close it; other stores: no-op."""
    if isinstance(objects, WriteBehindObjectStore):
        objects.close()


def discard_abandoned_staging(staging_root: Path) -> int:
    """Remove the staging folders of processes that died; returns how many blobs they held."""
    discarded = 0
    for lock_path in sorted(staging_root.glob(f"[!.]*{_LOCK_SUFFIX}")):  # `.x.lock`: being claimed
        with contextlib.suppress(FileNotFoundError), open(lock_path, "r+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            folder = lock_path.with_suffix("")
            discarded += sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
            shutil.rmtree(folder, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
    return discarded


def _claim_staging_folder(staging_root: Path) -> tuple[Path, TextIO]:
    """A new `<id>.lock` (the folder `<id>/` is this process's), flocked before it gets its name, so
    no other process can take it for abandoned; the flock lasts while the returned handle is open."""
    name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    pending = staging_root / f".{name}{_LOCK_SUFFIX}"
    handle = open(pending, "w")  # noqa: SIM115 - held open for the store's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        final = staging_root / f"{name}{_LOCK_SUFFIX}"
        os.replace(pending, final)
    except OSError:
        handle.close()
        raise
    return final, handle
