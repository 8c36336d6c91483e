"""train_state snapshots: what they hold, and how they are written and read back.

A train_state snapshot holds the backend's blobs (`model`, `optimizer`:
safetensors), `state` (JSON: the backend's meta, such as scheduler and RNG
states, and the loop's own state), the config.json and tokenizer files of the
model being trained (so `snapshot export` can rebuild it without the base
model) and, in its manifest, an `extra` dict (algorithm, model class, LoRA,
base model, config digest, ...).

Plain functions over a store and an object store; `rollout.run` binds them to
a run (parent chain, recorder events, pruning).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.backends.base import BackendState
from rollout.data.loader import DataCursor
from rollout.models.load import hf_model
from rollout.snapshots import Blob, commit_snapshot, read_snapshot_blob
from rollout.store.base import SnapshotRecord, Store
from rollout.store.objects import ObjectStore


def model_file_blobs(model: Any, tokenizer: Any) -> dict[str, bytes]:
    """config.json of the model being trained (LoRA merged away) and the tokenizer files."""
    blobs = {"model_config": hf_model(model).config.to_json_string(use_diff=False).encode()}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                blobs[f"tokenizer/{path.name}"] = path.read_bytes()
    return blobs


def commit_train_state(
    store: Store,
    objects: ObjectStore,
    state: BackendState,
    *,
    run_id: str,
    step: int,
    loop_state: Mapping[str, Any],
    static_blobs: Mapping[str, bytes],
    extra: Mapping[str, Any],
    parent_id: str | None,
) -> SnapshotRecord:
    """Write one train_state snapshot (blobs first, then the row)."""
    blobs: dict[str, Blob] = {}
    for name, data in state.blobs.items():
        meta = {"tensors": dict(state.tensors[name])} if name in state.tensors else {}
        blobs[name] = Blob(data=bytes(data), meta=meta)
    for name, data in static_blobs.items():
        blobs[name] = Blob(data=data)
    payload = {"backend": dict(state.meta), "loop": dict(loop_state)}
    blobs["state"] = Blob(data=json.dumps(payload, sort_keys=True).encode())
    return commit_snapshot(
        store, objects, run_id=run_id, kind="train_state", step=step,
        blobs=blobs, extra=dict(extra), parent_id=parent_id,
    )


def read_train_state(objects: ObjectStore, record: SnapshotRecord) -> tuple[BackendState, dict[str, Any]]:
    """The backend state and loop state of a train_state snapshot (every blob digest-verified)."""
    payload = json.loads(read_snapshot_blob(objects, record, "state"))
    names = [n for n in record.manifest["blobs"] if n in ("model", "optimizer")]
    blobs = {n: read_snapshot_blob(objects, record, n) for n in names}
    return BackendState(blobs=blobs, meta=payload["backend"]), payload["loop"]


@dataclass
class LoopState:
    """What the loop itself carries across a resume (the backend carries the rest)."""

    step: int
    cursor: DataCursor
    tokens_seen: int
    restored: dict[str, Any] = field(default_factory=dict)  # the whole saved loop state (RL keeps more in it)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor.to_dict(), "tokens_seen": self.tokens_seen}


def snapshot_due(every_steps: int | None, step: int, total_steps: int, *, steps_taken: int = 1) -> bool:
    """Whether the last `steps_taken` optimizer steps, ending at `step`, crossed a multiple of
    `every_steps`. Never at `total_steps`: the final snapshot is saved anyway. (RL takes
    `num_iterations` steps per batch and snapshots only between batches.)"""
    return bool(every_steps) and step < total_steps and step // every_steps > (step - steps_taken) // every_steps
