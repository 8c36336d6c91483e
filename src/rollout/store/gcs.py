"""`GcsObjectStore`: the content-addressed blob store in a Google Cloud Storage bucket (gcsfs).

    objects = GcsObjectStore("my-bucket", "rollout/objects", endpoint_url=None)

The contract of `S3ObjectStore`, through gcsfs: blobs at `prefix/ab/cd/<digest>`;
blobs of 8 MiB and more go up as resumable uploads in 8 MiB chunks; gcsfs
retries transient failures itself (5xx, 429, connection errors; 6 attempts
with exponential backoff); every read is hashed and a mismatch is
`BlobCorrupted`, and `get_file` renames into place only after the check.

Credentials come from Google's usual chain (`GOOGLE_APPLICATION_CREDENTIALS`,
gcloud's application-default login, the metadata server), never from the run
config; with none, gcsfs goes on anonymously (enough for an emulator). gcsfs is
the `gcs` extra (`pip install 'rollout[gcs]'`); this module is imported only
when a gcs store is opened.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import google.auth.exceptions
from gcsfs.core import GCSFileSystem  # the plain JSON-API filesystem: no zonal/HNS gRPC probing

from rollout.errors import BlobCorrupted, BlobNotFound, StorageError
from rollout.store.objects import _install, _temp_file, check_digest, hash_bytes, hash_file

CHUNK_SIZE = 8 << 20
"""Blobs at least this big are uploaded in resumable chunks of this size (a multiple of 256 KiB)."""


class GcsObjectStore:
    """An `ObjectStore` in a GCS bucket (`gs://bucket/prefix/ab/cd/<digest>`)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.location = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self._root = f"{bucket}/{self.prefix}" if self.prefix else bucket
        with self._errors("connect"):
            # No listing cache: `iter_digests` must see deletes made by other processes.
            self.fs = GCSFileSystem(endpoint_url=endpoint_url, skip_instance_cache=True, use_listings_cache=False)
        self._path_pattern = re.compile(re.escape(self._root) + r"/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{64})")

    def path_for(self, digest: str) -> str:
        check_digest(digest)
        return f"{self._root}/{digest[:2]}/{digest[2:4]}/{digest}"

    def check_bucket(self) -> None:
        """StorageError unless the bucket exists and these credentials can reach it."""
        with self._errors("open the bucket"):
            self.fs.info(self.bucket)

    def put_bytes(self, data: bytes) -> str:
        digest = hash_bytes(data)
        if not self.exists(digest):
            with self._errors(f"upload blob {digest}"):
                self.fs.pipe_file(self.path_for(digest), data, chunksize=CHUNK_SIZE)
        return digest

    def put_file(self, path: Path) -> str:
        try:
            digest = hash_file(path)
        except OSError as err:
            raise StorageError(f"cannot store file {path} in {self.location}: {err.strerror or err}") from err
        if not self.exists(digest):
            with self._errors(f"upload blob {digest} from {path}"):
                self.fs.put_file(str(path), self.path_for(digest), chunksize=CHUNK_SIZE)
        return digest

    def get_bytes(self, digest: str) -> bytes:
        path = self.path_for(digest)
        with self._errors(f"download blob {digest}", digest=digest):
            data = self.fs.cat_file(path)
        actual = hash_bytes(data)
        if actual != digest:
            raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({self.location})")
        return data

    def get_file(self, digest: str, dest: Path) -> None:
        path = self.path_for(digest)
        dest = Path(dest)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with _temp_file(dest.parent) as (tmp, handle):
                handle.close()  # gcsfs writes the file by name
                with self._errors(f"download blob {digest}", digest=digest):
                    self.fs.get_file(path, str(tmp))
                actual = hash_file(tmp)
                if actual != digest:
                    raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({self.location})")
                _install(tmp, dest)
        except OSError as err:
            raise StorageError(f"cannot copy blob {digest} to {dest}: {err.strerror or err}") from err

    def exists(self, digest: str) -> bool:
        path = self.path_for(digest)
        try:
            with self._errors(f"look up blob {digest}", digest=digest):
                self.fs.info(path)
        except BlobNotFound:
            return False
        return True

    def delete(self, digest: str) -> None:
        path = self.path_for(digest)
        with contextlib.suppress(BlobNotFound), self._errors(f"delete blob {digest}", digest=digest):
            self.fs.rm_file(path)

    def iter_digests(self) -> Iterator[str]:
        digests = []
        with self._errors("list blobs"):
            paths = self.fs.find(self._root)
        for path in paths:
            match = self._path_pattern.fullmatch(path)
            if match and match[3][:2] == match[1] and match[3][2:4] == match[2]:
                digests.append(match[3])
        yield from sorted(digests)

    @contextlib.contextmanager
    def _errors(self, action: str, *, digest: str | None = None) -> Iterator[None]:
        """gcsfs / google-auth failures as one-line StorageErrors; a missing object is BlobNotFound."""
        try:
            yield
        except FileNotFoundError:
            if digest is None:  # not a blob: the bucket itself
                missing = f"bucket {self.bucket!r} does not exist"
                raise StorageError(f"cannot {action} in {self.location}: {missing}") from None
            raise BlobNotFound(f"blob not found: {digest} (object store {self.location})") from None
        except (OSError, ValueError, aiohttp.ClientError, google.auth.exceptions.GoogleAuthError) as err:
            # gcsfs's HttpError is an OSError; google-auth's: no credentials, a bad key file
            raise StorageError(f"cannot {action} in {self.location}: {type(err).__name__}: {err}") from err
