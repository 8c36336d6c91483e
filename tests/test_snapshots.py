"""Snapshot ids, commit/read, prune and garbage collection over a real SQLite store and fs object store."""

from __future__ import annotations

import json

import blake3
import pytest

from rollout.errors import StorageError
from rollout.snapshots import (
    Blob,
    canonical_json,
    collect_garbage,
    commit_snapshot,
    compute_snapshot_id,
    copy_snapshot_blob,
    prune_snapshots,
    read_snapshot_blob,
)
from rollout.store import FsObjectStore, open_store


@pytest.fixture
def stores(tmp_path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    objects = FsObjectStore(tmp_path / "objects")
    yield store, objects
    store.close()


@pytest.fixture
def run_id(stores):
    return stores[0].create_run(algorithm="sft", config_digest="d", config_json="{}").id


def test_canonical_json():
    assert canonical_json({"b": 1, "a": [1.5, "é"], "c": {"z": None, "y": True}}) == (
        '{"a":[1.5,"é"],"b":1,"c":{"y":true,"z":null}}'.encode()
    )
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            canonical_json({"x": bad})


def test_snapshot_id_is_blake3_of_the_canonical_manifest(stores, run_id, tmp_path):
    store, objects = stores
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00\x01" * 100)
    record = commit_snapshot(
        store,
        objects,
        run_id=run_id,
        kind="train_state",
        step=10,
        blobs={
            "model": Blob(weights, meta={"dtype": "float32", "shape": (10, 10)}),
            "loop": Blob(b'{"step":10}'),
        },
        extra={"cursor": 3},
        label="best",
        metadata={"eval/acc": 0.5},
    )
    expected_manifest = {
        "format": 1,
        "kind": "train_state",
        "run_id": run_id,
        "step": 10,
        "label": "best",
        "parent_id": None,
        "blobs": {
            "loop": {"digest": blake3.blake3(b'{"step":10}').hexdigest(), "size": 11},
            "model": {
                "digest": blake3.blake3(b"\x00\x01" * 100).hexdigest(),
                "size": 200,
                "dtype": "float32",
                "shape": [10, 10],
            },
        },
        "extra": {"cursor": 3},
    }
    assert record.manifest == expected_manifest
    by_hand = json.dumps(expected_manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert record.id == blake3.blake3(by_hand.encode("utf-8")).hexdigest()
    assert record.id == compute_snapshot_id(expected_manifest)
    assert (record.kind, record.step, record.label, record.metadata) == (
        "train_state",
        10,
        "best",
        {"eval/acc": 0.5},
    )
    assert store.get_snapshot(record.id[:8]) == record


def test_commit_then_read_blobs(stores, run_id, tmp_path):
    store, objects = stores
    record = commit_snapshot(
        store, objects, run_id=run_id, kind="buffer", step=1, blobs={"samples": Blob(b"[1,2,3]")}
    )
    assert read_snapshot_blob(objects, record, "samples") == b"[1,2,3]"
    copy_snapshot_blob(objects, record, "samples", tmp_path / "copy.json")
    assert (tmp_path / "copy.json").read_bytes() == b"[1,2,3]"
    with pytest.raises(StorageError, match=f"snapshot {record.id} has no blob named 'model'"):
        read_snapshot_blob(objects, record, "model")

    again = commit_snapshot(
        store, objects, run_id=run_id, kind="buffer", step=1, blobs={"samples": Blob(b"[1,2,3]")}
    )
    assert again == record  # same content, same id, one row
    assert len(store.list_snapshots()) == 1


def test_commit_rejects_bad_input(stores, run_id):
    store, objects = stores
    with pytest.raises(StorageError, match="unknown snapshot kind"):
        commit_snapshot(store, objects, run_id=run_id, kind="weights", step=0, blobs={})
    with pytest.raises(StorageError, match="reserved"):
        commit_snapshot(
            store, objects, run_id=run_id, kind="buffer", step=0, blobs={"a": Blob(b"x", meta={"size": 1})}
        )
    with pytest.raises(StorageError, match="not canonical JSON"):
        commit_snapshot(
            store, objects, run_id=run_id, kind="buffer", step=0, blobs={}, extra={"loss": float("nan")}
        )
    assert store.list_snapshots() == []


def commit_steps(store, objects, run_id, kind, steps, labeled=()):
    return [
        commit_snapshot(
            store,
            objects,
            run_id=run_id,
            kind=kind,
            step=step,
            blobs={"state": Blob(f"{kind}-{step}".encode()), "shared": Blob(b"tokenizer")},
            label="keep" if step in labeled else None,
        )
        for step in steps
    ]


def test_prune_keeps_last_per_kind_and_labeled(stores, run_id):
    store, objects = stores
    commit_steps(store, objects, run_id, "train_state", [1, 2, 3, 4, 5], labeled=[1])
    commit_steps(store, objects, run_id, "buffer", [1, 2, 3])
    other_run = store.create_run(algorithm="sft", config_digest="d", config_json="{}").id
    commit_steps(store, objects, other_run, "train_state", [1, 2, 3])

    assert prune_snapshots(store, run_id=run_id, keep_last=2) == 3  # train_state 2, 3 and buffer 1
    remaining = {(s.kind, s.step) for s in store.list_snapshots(run_id=run_id)}
    assert remaining == {
        ("train_state", 1),
        ("train_state", 4),
        ("train_state", 5),
        ("buffer", 2),
        ("buffer", 3),
    }
    assert len(store.list_snapshots(run_id=other_run)) == 3

    assert prune_snapshots(store, run_id=run_id, keep_last=2) == 0
    assert prune_snapshots(store, run_id=run_id, keep_last=1, keep_labeled=False) == 3
    remaining = {(s.kind, s.step) for s in store.list_snapshots(run_id=run_id)}
    assert remaining == {("train_state", 5), ("buffer", 3)}
    with pytest.raises(StorageError):
        prune_snapshots(store, run_id=run_id, keep_last=-1)


def test_gc_deletes_exactly_the_unreferenced_blobs(stores, run_id):
    store, objects = stores
    records = commit_steps(store, objects, run_id, "train_state", [1, 2, 3])
    orphan = objects.put_bytes(b"left by a crashed commit")
    assert len(list(objects.iter_digests())) == 5  # 3 states + 1 shared + orphan

    assert collect_garbage(store, objects) == 1
    assert not objects.exists(orphan)

    assert prune_snapshots(store, run_id=run_id, keep_last=1) == 2
    assert collect_garbage(store, objects) == 2  # states 1 and 2; "shared" is still referenced by step 3
    kept = records[-1]
    assert sorted(objects.iter_digests()) == sorted(b["digest"] for b in kept.manifest["blobs"].values())
    assert read_snapshot_blob(objects, kept, "state") == b"train_state-3"
    assert collect_garbage(store, objects) == 0
