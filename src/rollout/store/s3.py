"""`S3ObjectStore`: the content-addressed blob store in an S3 bucket (boto3).

    objects = S3ObjectStore("my-bucket", "rollout/objects", endpoint_url=None, region=None)

Blobs are objects at `prefix/ab/cd/<digest>`, the fs layout. Large blobs go up
and come down through boto3's transfer manager: multipart above 8 MiB, parts in
parallel. Every request is retried by botocore's "standard" mode (transient
5xx, throttling and connection errors, exponential backoff with jitter, up to
`max_attempts` attempts in all). Every read is verified like fs: the bytes are
hashed and a mismatch is `BlobCorrupted`; `get_file` downloads to a temp file
beside `dest` and renames it into place only after the check.

Credentials come only from the AWS chain (`AWS_*` environment variables,
`~/.aws` files, instance roles), never from the run config. boto3 is the `s3`
extra (`pip install 'rollout[s3]'`); this module is imported only when an s3
store is opened.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.exceptions
from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from rollout.errors import BlobCorrupted, BlobNotFound, StorageError
from rollout.store.objects import _install, _sync_and_close, _temp_file, check_digest, hash_bytes, hash_file

MULTIPART_THRESHOLD = 8 << 20
"""Blobs at least this big are uploaded (and downloaded) in parts of this size."""
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


class S3ObjectStore:
    """An `ObjectStore` in an S3 bucket (`s3://bucket/prefix/ab/cd/<digest>`)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 5,
        max_concurrency: int = 4,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.location = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts},  # first try included
            # Path-style URLs: custom endpoints (MinIO, a local test server) rarely resolve bucket subdomains.
            s3={"addressing_style": "path"} if endpoint_url else None,
            connect_timeout=10,
            read_timeout=60,
        )
        with self._errors("connect"):
            session = boto3.session.Session()
            self.client = session.client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config
            )
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_THRESHOLD,
            max_concurrency=max_concurrency,
        )
        self._key_pattern = re.compile(
            re.escape(self.prefix + "/" if self.prefix else "") + r"([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{64})"
        )

    def key_for(self, digest: str) -> str:
        check_digest(digest)
        key = f"{digest[:2]}/{digest[2:4]}/{digest}"
        return f"{self.prefix}/{key}" if self.prefix else key

    def check_bucket(self) -> None:
        """StorageError unless the bucket exists and these credentials can reach it."""
        with self._errors("open the bucket"):
            self.client.head_bucket(Bucket=self.bucket)

    def put_bytes(self, data: bytes) -> str:
        digest = hash_bytes(data)
        if not self.exists(digest):
            with self._errors(f"upload blob {digest}"):
                self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.key_for(digest), Config=self.transfer)
        return digest

    def put_file(self, path: Path) -> str:
        try:
            digest = hash_file(path)
        except OSError as err:
            raise StorageError(f"cannot store file {path} in {self.location}: {err.strerror or err}") from err
        if not self.exists(digest):
            with self._errors(f"upload blob {digest} from {path}"):
                self.client.upload_file(str(path), self.bucket, self.key_for(digest), Config=self.transfer)
        return digest

    def get_bytes(self, digest: str) -> bytes:
        key = self.key_for(digest)
        buffer = io.BytesIO()
        with self._errors(f"download blob {digest}", digest=digest):
            self.client.download_fileobj(self.bucket, key, buffer, Config=self.transfer)
        data = buffer.getvalue()
        actual = hash_bytes(data)
        if actual != digest:
            raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({self.location})")
        return data

    def get_file(self, digest: str, dest: Path) -> None:
        key = self.key_for(digest)
        dest = Path(dest)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with _temp_file(dest.parent) as (tmp, handle):
                with self._errors(f"download blob {digest}", digest=digest):
                    self.client.download_fileobj(self.bucket, key, handle, Config=self.transfer)
                _sync_and_close(handle)
                actual = hash_file(tmp)  # parts land out of order: hash the whole file once it is complete
                if actual != digest:
                    raise BlobCorrupted(f"blob {digest} is corrupted: its bytes hash to {actual} ({self.location})")
                _install(tmp, dest)
        except OSError as err:
            raise StorageError(f"cannot copy blob {digest} to {dest}: {err.strerror or err}") from err

    def exists(self, digest: str) -> bool:
        key = self.key_for(digest)
        try:
            with self._errors(f"look up blob {digest}", digest=digest):
                self.client.head_object(Bucket=self.bucket, Key=key)
        except BlobNotFound:
            return False
        return True

    def delete(self, digest: str) -> None:
        key = self.key_for(digest)
        with self._errors(f"delete blob {digest}"):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def iter_digests(self) -> Iterator[str]:
        digests = []
        with self._errors("list blobs"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}/" if self.prefix else ""
            )
            for page in pages:
                for item in page.get("Contents", []):
                    match = self._key_pattern.fullmatch(item["Key"])
                    if match and match[3][:2] == match[1] and match[3][2:4] == match[2]:
                        digests.append(match[3])
        yield from sorted(digests)

    @contextlib.contextmanager
    def _errors(self, action: str, *, digest: str | None = None) -> Iterator[None]:
        """botocore / boto3 failures as one-line StorageErrors; a missing key is BlobNotFound."""
        try:
            yield
        except botocore.exceptions.ClientError as err:
            error = err.response.get("Error", {})
            code = str(error.get("Code", ""))
            if digest is not None and code in _MISSING_CODES:
                raise BlobNotFound(f"blob not found: {digest} (object store {self.location})") from None
            if code == "NoSuchBucket" or (code == "404" and digest is None):
                missing = f"bucket {self.bucket!r} does not exist"
                raise StorageError(f"cannot {action} in {self.location}: {missing}") from err
            message = error.get("Message") or err
            raise StorageError(f"cannot {action} in {self.location}: {code}: {message}", details=[str(err)]) from err
        except botocore.exceptions.NoCredentialsError as err:
            raise StorageError(
                f"cannot {action} in {self.location}: no AWS credentials found",
                details=["set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE (the usual AWS chain)"],
            ) from err
        except (botocore.exceptions.BotoCoreError, S3UploadFailedError, S3TransferFailedError) as err:
            raise StorageError(f"cannot {action} in {self.location}: {err}") from err
