"""Snapshots: named sets of content-addressed blobs plus a manifest, identified by the manifest's hash.

A snapshot's id is the blake3 hex digest of its canonical manifest, so equal
content gives an equal id. `commit_snapshot` puts every blob before it writes
the row: a crash in between leaves unreferenced blobs (which `collect_garbage`
removes), never a row that points at missing bytes. With a write-behind store
(s3/gcs during a run) the puts return once the blobs are staged locally, and the
row is written by the store's upload thread once they are all in the bucket:
the training loop does not wait for the upload.

What goes into the blobs is the caller's business (safetensors for tensors,
JSON for everything else: never pickle); this module only moves bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from rollout.errors import StorageError
from rollout.store.base import SnapshotRecord, Store
from rollout.store.objects import ObjectStore
from rollout.store.write_behind import WriteBehindObjectStore

MANIFEST_FORMAT = 1
SNAPSHOT_KINDS: frozenset[str] = frozenset({"train_state", "buffer", "episodic_memory", "process"})
_RESERVED_BLOB_KEYS = frozenset({"digest", "size"})


def canonical_json(obj: object) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace; NaN/Infinity raise ValueError."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def compute_snapshot_id(manifest: dict) -> str:
    """The snapshot id: blake3 hex (64 chars) of the canonical manifest."""
    return blake3.blake3(canonical_json(manifest)).hexdigest()


@dataclass(frozen=True)
class Blob:
    """One named piece of a snapshot: bytes in memory or a file, with JSON metadata (dtypes, shapes, ...)."""

    data: bytes | Path
    meta: dict = field(default_factory=dict)


def commit_snapshot(
    store: Store,
    objects: ObjectStore,
    *,
    run_id: str,
    kind: str,
    step: int,
    blobs: Mapping[str, Blob],
    extra: Mapping | None = None,
    label: str | None = None,
    parent_id: str | None = None,
    metadata: Mapping | None = None,
) -> SnapshotRecord:
    """Store `blobs`, then record the snapshot; returns the stored record (idempotent for equal content).

    With a `WriteBehindObjectStore` the row is written later, by its upload thread, once every blob is
    in the bucket; the record returned is the one that row will hold."""
    if kind not in SNAPSHOT_KINDS:
        raise StorageError(f"unknown snapshot kind {kind!r}; expected one of {sorted(SNAPSHOT_KINDS)}")
    entries = {name: _put_blob(objects, name, blob) for name, blob in sorted(blobs.items())}
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": kind,
        "run_id": run_id,
        "step": step,
        "label": label,
        "parent_id": parent_id,
        "blobs": entries,
        "extra": dict(extra or {}),
    }
    try:
        encoded = canonical_json(manifest)
    except (TypeError, ValueError) as err:
        raise StorageError(
            f"snapshot manifest of run {run_id} step {step} is not canonical JSON: {err}"
        ) from err
    record = SnapshotRecord(
        id=blake3.blake3(encoded).hexdigest(),
        run_id=run_id,
        kind=kind,
        step=step,
        label=label,
        parent_id=parent_id,
        created_at=time.time(),
        manifest=json.loads(encoded),  # exactly what the store keeps (tuples become lists, ...)
        metadata=dict(metadata or {}),
    )
    if isinstance(objects, WriteBehindObjectStore):
        digests = [entry["digest"] for entry in entries.values()]
        objects.commit_when_durable(digests, lambda: store.add_snapshot(record))
        return record
    store.add_snapshot(record)
    return store.get_snapshot(record.id)


def read_snapshot_blob(objects: ObjectStore, record: SnapshotRecord, name: str) -> bytes:
    """The verified bytes of the snapshot's blob `name`."""
    return objects.get_bytes(_blob_entry(record, name)["digest"])


def copy_snapshot_blob(objects: ObjectStore, record: SnapshotRecord, name: str, dest: Path) -> None:
    """Write the snapshot's blob `name` to `dest`, verified and streamed (for large weights)."""
    objects.get_file(_blob_entry(record, name)["digest"], dest)


def prune_snapshots(store: Store, *, run_id: str, keep_last: int, keep_labeled: bool = True) -> int:
    """Delete a run's snapshot rows except, per kind, the `keep_last` highest steps (and labeled ones).

    Blobs stay until `collect_garbage`. Returns the number of rows deleted.
    """
    if keep_last < 0:
        raise StorageError(f"keep_last must be >= 0, got {keep_last}")
    by_kind: dict[str, list[SnapshotRecord]] = {}
    for record in store.list_snapshots(run_id=run_id):
        by_kind.setdefault(record.kind, []).append(record)
    doomed: list[str] = []
    for records in by_kind.values():
        newest_first = sorted(records, key=lambda r: (r.step, r.created_at, r.id), reverse=True)
        for record in newest_first[keep_last:]:
            if not (keep_labeled and record.label):
                doomed.append(record.id)
    return store.delete_snapshots(doomed) if doomed else 0


def collect_garbage(store: Store, objects: ObjectStore) -> int:
    """Delete every blob no snapshot manifest references; returns how many went.

    Don't run it while another process is committing a snapshot: that commit's
    blobs are unreferenced until its row is written (with s3/gcs, until its upload ends).
    """
    referenced = {
        entry["digest"]
        for record in store.list_snapshots()
        for entry in record.manifest.get("blobs", {}).values()
    }
    unreferenced = [digest for digest in objects.iter_digests() if digest not in referenced]
    for digest in unreferenced:
        objects.delete(digest)
    return len(unreferenced)


def _put_blob(objects: ObjectStore, name: str, blob: Blob) -> dict:
    clash = _RESERVED_BLOB_KEYS & set(blob.meta)
    if clash:
        raise StorageError(f"blob {name!r}: meta keys {sorted(clash)} are reserved by the manifest")
    if isinstance(blob.data, bytes | bytearray | memoryview):
        data = bytes(blob.data)
        digest, size = objects.put_bytes(data), len(data)
    else:
        path = Path(blob.data)
        try:
            size = path.stat().st_size
        except OSError as err:
            raise StorageError(f"blob {name!r}: cannot read {path}: {err}") from err
        digest = objects.put_file(path)
    return {"digest": digest, "size": size, **blob.meta}


def _blob_entry(record: SnapshotRecord, name: str) -> dict:
    blobs = record.manifest.get("blobs", {})
    if name not in blobs:
        raise StorageError(
            f"snapshot {record.id} has no blob named {name!r}",
            details=[f"blobs: {', '.join(sorted(blobs)) or '(none)'}"],
        )
    return blobs[name]
