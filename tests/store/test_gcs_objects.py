"""The gcs object store against a real GCS JSON-API server (gcp-storage-emulator on 127.0.0.1, see
conftest.py): the contract the s3 tests check, through gcsfs. Faults are the emulator answering 503
on purpose (`gcs_traffic.fail`)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from gcsfs.core import GCSFileSystem

from rollout.errors import BlobCorrupted, BlobNotFound, StorageError
from rollout.snapshots import Blob, collect_garbage, commit_snapshot
from rollout.store import open_object_store, open_store
from rollout.store.gcs import GcsObjectStore
from rollout.store.write_behind import WriteBehindObjectStore


def gcs_store(bucket, prefix: str = "objects") -> GcsObjectStore:
    store = open_object_store("gcs", path=Path("unused"), url=bucket.url(prefix), endpoint_url=bucket.endpoint_url)
    assert isinstance(store, GcsObjectStore)
    return store


def raw_fs(bucket) -> GCSFileSystem:
    return GCSFileSystem(endpoint_url=bucket.endpoint_url, skip_instance_cache=True, use_listings_cache=False)


def digest_of(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def test_put_get_verify_in_the_fs_layout(gcs_bucket, gcs_traffic):
    objects = gcs_store(gcs_bucket)
    data = b"hello, rollout"
    digest = objects.put_bytes(data)
    assert digest == digest_of(data)
    assert raw_fs(gcs_bucket).find(gcs_bucket.name) == [f"{gcs_bucket.name}/objects/{digest[:2]}/{digest[2:4]}/{digest}"]
    assert objects.get_bytes(digest) == data
    assert objects.exists(digest) and not objects.exists("ab" * 32)
    assert objects.put_bytes(data) == digest  # already there: no second upload
    assert len(gcs_traffic.uploads()) == 1
    assert list(objects.iter_digests()) == [digest]
    objects.delete(digest)
    objects.delete(digest)  # deleting a missing blob is fine
    assert list(objects.iter_digests()) == []
    with pytest.raises(BlobNotFound, match=f"blob not found: {digest} \\(object store gs://{gcs_bucket.name}/objects\\)"):
        objects.get_bytes(digest)


def test_a_blob_over_8_mib_goes_up_in_resumable_chunks_with_a_503_retried(gcs_bucket, gcs_traffic, tmp_path):
    objects = gcs_store(gcs_bucket)
    gcs_traffic.fail(lambda method, path: "uploadType=resumable&upload_id=" in path, count=1)  # a chunk
    data = os.urandom(9 * (1 << 20) + 17)
    source = tmp_path / "weights.bin"
    source.write_bytes(data)
    assert objects.put_file(source) == (digest := digest_of(data))
    chunks = [path for _, path in gcs_traffic.uploads() if "upload_id=" in path]
    assert gcs_traffic.failed == 1 and len(chunks) == 3  # 8 MiB + the rest, the first one twice
    dest = tmp_path / "out" / "weights.bin"
    objects.get_file(digest, dest)
    assert dest.read_bytes() == data
    assert os.listdir(tmp_path / "out") == ["weights.bin"]


def test_transient_failures_on_reads_are_retried(gcs_bucket, gcs_traffic):
    objects = gcs_store(gcs_bucket)
    digest = objects.put_bytes(b"survives a 503")
    gcs_traffic.fail(lambda method, path: method == "GET" and "alt=media" in path, count=1)
    assert objects.get_bytes(digest) == b"survives a 503"
    assert gcs_traffic.failed == 1


def test_digest_mismatch_is_blob_corrupted_on_every_read(gcs_bucket, tmp_path):
    objects = gcs_store(gcs_bucket)
    digest = objects.put_bytes(b"x" * 1000)
    raw_fs(gcs_bucket).pipe_file(objects.path_for(digest), b"x" * 999 + b"y")
    with pytest.raises(BlobCorrupted, match=f"blob {digest} is corrupted: its bytes hash to {digest_of(b'x' * 999 + b'y')}"):
        objects.get_bytes(digest)
    dest = tmp_path / "restored.bin"
    with pytest.raises(BlobCorrupted):
        objects.get_file(digest, dest)
    assert list(tmp_path.iterdir()) == []


def test_iter_digests_lists_only_blobs_under_the_prefix_and_gc_works(gcs_bucket, tmp_path):
    objects = gcs_store(gcs_bucket, prefix="team/store")
    d = objects.put_bytes(b"stray twin")
    fs = raw_fs(gcs_bucket)
    for stray in ("team/store/README", f"team/store/ff/ff/{d}", f"team/store-2/{d[:2]}/{d[2:4]}/{d}"):
        fs.pipe_file(f"{gcs_bucket.name}/{stray}", b"?")
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    kept = commit_snapshot(store, objects, run_id=run.id, kind="buffer", step=1, blobs={"b": Blob(b"kept")})
    assert list(objects.iter_digests()) == sorted([d, kept.manifest["blobs"]["b"]["digest"]])
    assert collect_garbage(store, objects) == 1
    assert list(objects.iter_digests()) == [kept.manifest["blobs"]["b"]["digest"]]
    assert fs.exists(f"{gcs_bucket.name}/team/store/README")  # not a blob: never touched
    store.close()


def test_write_behind_over_gcs_commits_the_row_after_the_upload(gcs_bucket, tmp_path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    objects = open_object_store(
        "gcs", path=tmp_path / "staging", url=gcs_bucket.url(), endpoint_url=gcs_bucket.endpoint_url, write_behind=True
    )
    assert isinstance(objects, WriteBehindObjectStore)
    record = commit_snapshot(store, objects, run_id=run.id, kind="buffer", step=1, blobs={"b": Blob(b"up")})
    objects.close()
    assert [r.id for r in store.list_snapshots()] == [record.id]
    assert gcs_store(gcs_bucket).get_bytes(record.manifest["blobs"]["b"]["digest"]) == b"up"
    assert os.listdir(tmp_path / "staging") == []
    store.close()


def test_a_missing_bucket_fails_at_open(gcs_bucket):
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        open_object_store("gcs", path=Path("x"), url="gs://no-such-bucket-here/p", endpoint_url=gcs_bucket.endpoint_url)
