"""FsObjectStore on a real directory tree."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest

from rollout.errors import BlobCorrupted, BlobNotFound, StorageError
from rollout.store import FsObjectStore, open_object_store


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.startswith(".tmp-")]


def test_put_get_round_trip_in_sharded_layout(tmp_path):
    objects = FsObjectStore(tmp_path / "objects")
    data = b"hello, rollout"
    digest = objects.put_bytes(data)
    assert digest == blake3.blake3(data).hexdigest()
    assert len(digest) == 64 and digest == digest.lower()
    assert (tmp_path / "objects" / digest[:2] / digest[2:4] / digest).read_bytes() == data
    assert objects.get_bytes(digest) == data
    assert objects.exists(digest)
    assert list(objects.iter_digests()) == [digest]


def test_put_is_idempotent(tmp_path):
    objects = FsObjectStore(tmp_path)
    first = objects.put_bytes(b"same")
    blob = objects.path_for(first)
    mtime = blob.stat().st_mtime_ns
    assert objects.put_bytes(b"same") == first
    source = tmp_path / "same.bin"
    source.write_bytes(b"same")
    assert objects.put_file(source) == first
    assert blob.stat().st_mtime_ns == mtime
    assert list(objects.iter_digests()) == [first]
    assert temp_files(tmp_path) == []


def test_put_file_and_get_file_stream_large_blobs(tmp_path):
    objects = FsObjectStore(tmp_path / "objects")
    source = tmp_path / "weights.bin"
    data = os.urandom(3 * (1 << 20) + 17)  # several read chunks
    source.write_bytes(data)
    digest = objects.put_file(source)
    assert digest == blake3.blake3(data).hexdigest()
    dest = tmp_path / "out" / "nested" / "weights.bin"
    objects.get_file(digest, dest)
    assert dest.read_bytes() == data
    assert temp_files(tmp_path) == []


def test_flipped_byte_is_detected_on_every_read(tmp_path):
    objects = FsObjectStore(tmp_path / "objects")
    digest = objects.put_bytes(b"x" * 1000)
    blob = objects.path_for(digest)
    corrupted = bytearray(blob.read_bytes())
    corrupted[500] ^= 0x01
    blob.write_bytes(bytes(corrupted))
    with pytest.raises(BlobCorrupted, match=f"blob {digest} is corrupted: "):
        objects.get_bytes(digest)
    dest = tmp_path / "restored.bin"
    with pytest.raises(BlobCorrupted):
        objects.get_file(digest, dest)
    assert not dest.exists()
    assert temp_files(tmp_path) == []


def test_missing_blob(tmp_path):
    objects = FsObjectStore(tmp_path)
    digest = "ab" * 32
    assert not objects.exists(digest)
    with pytest.raises(BlobNotFound, match=f"blob not found: {digest}"):
        objects.get_bytes(digest)
    with pytest.raises(BlobNotFound):
        objects.get_file(digest, tmp_path / "x")
    objects.delete(digest)  # deleting a missing blob is fine


@pytest.mark.parametrize(
    "bad", ["../x", "../" * 3 + "etc/passwd", "AB" * 32, "ab" * 31, "ab" * 33, "g" * 64, "", "/" + "a" * 63]
)
def test_bad_digests_never_touch_the_filesystem(tmp_path, bad):
    objects = FsObjectStore(tmp_path / "objects")
    with pytest.raises(StorageError, match="invalid blob digest"):
        objects.get_bytes(bad)
    with pytest.raises(StorageError, match="invalid blob digest"):
        objects.exists(bad)
    with pytest.raises(StorageError, match="invalid blob digest"):
        objects.delete(bad)
    with pytest.raises(StorageError, match="invalid blob digest"):
        objects.get_file(bad, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_delete_and_iter_digests(tmp_path):
    objects = FsObjectStore(tmp_path)
    digests = sorted(objects.put_bytes(bytes([i])) for i in range(5))
    (tmp_path / "README").write_text("not a blob")
    assert list(objects.iter_digests()) == digests
    objects.delete(digests[2])
    assert list(objects.iter_digests()) == digests[:2] + digests[3:]
    assert not objects.exists(digests[2])


def test_put_file_of_a_missing_path_is_a_storage_error(tmp_path):
    objects = FsObjectStore(tmp_path / "objects")
    with pytest.raises(StorageError, match="cannot store file"):
        objects.put_file(tmp_path / "nope.bin")
    assert temp_files(tmp_path) == []


def test_open_object_store_builders(tmp_path):
    assert isinstance(open_object_store("fs", path=tmp_path / "o"), FsObjectStore)
    assert (tmp_path / "o").is_dir()
    for backend in ("s3", "gcs"):  # the bucket stores: tests/store/test_s3_objects.py, test_gcs_objects.py
        with pytest.raises(StorageError, match=f"the {backend} object store needs a url"):
            open_object_store(backend, path=tmp_path)
