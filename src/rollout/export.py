"""Write Hugging Face–loadable model folders: from a live model or from a snapshot.

    rollout snapshot export <snapshot-id> OUT_DIR

The folder holds config.json, model.safetensors and the tokenizer files, and
loads with `AutoModelForCausalLM` (SFT) or `AutoModelForSequenceClassification`
(reward models). LoRA adapters are merged into the weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollout.errors import StorageError
from rollout.models.load import apply_lora
from rollout.snapshots import read_snapshot_blob
from rollout.store.base import SnapshotRecord, Store
from rollout.store.objects import ObjectStore


def export_model_dir(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    """Save `model` (LoRA merged) and `tokenizer` to `out_dir`, replacing it atomically."""
    import copy

    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.config.use_cache = True
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_snapshot(store: Store, objects: ObjectStore, record: SnapshotRecord, out_dir: Path) -> Path:
    """Rebuild the model of a train_state snapshot and export it (`snapshot export`)."""
    import torch
    from safetensors.torch import load as load_safetensors
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    if record.kind != "train_state":
        raise StorageError(f"snapshot {record.id[:12]} is a {record.kind} snapshot; only train_state holds a model")
    extra = record.manifest.get("extra", {})
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "config.json").write_bytes(read_snapshot_blob(objects, record, "model_config"))
        tok_dir = tmp / "tokenizer"
        tok_dir.mkdir()
        for name in record.manifest["blobs"]:
            if name.startswith("tokenizer/"):
                filename = name.removeprefix("tokenizer/")
                if "/" in filename or filename in ("", ".", ".."):
                    raise StorageError(f"snapshot {record.id[:12]}: bad tokenizer file name {filename!r}")
                (tok_dir / filename).write_bytes(read_snapshot_blob(objects, record, name))
        config = AutoConfig.from_pretrained(tmp)
        auto = AutoModelForSequenceClassification if extra.get("model_class") == "reward" else AutoModelForCausalLM
        model = auto.from_config(config, dtype=getattr(torch, str(config.dtype).removeprefix("torch.")) if config.dtype else None)
        if extra.get("lora"):
            model = apply_lora(model, task=extra.get("model_class", "causal_lm"), **extra["lora"])
        tensors = load_safetensors(read_snapshot_blob(objects, record, "model"))
        prefix = extra.get("policy_prefix")
        if prefix:  # e.g. PPO keeps policy and value model in one state: export the policy
            tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise StorageError(f"snapshot {record.id[:12]}: weights do not fit the model config ({missing[:3]} {unexpected[:3]})")
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        export_model_dir(model, tokenizer, out_dir)
    (Path(out_dir) / "rollout_snapshot.json").write_text(
        json.dumps({"snapshot_id": record.id, "run_id": record.run_id, "step": record.step}, indent=2) + "\n"
    )
    return Path(out_dir)
