"""The frozen reference policy of DPO, KTO, GRPO (beta > 0) and PPO (kl_coef > 0), in its three forms.

- `copy`: a second, frozen model loaded from `reference.uri` (default: the base model).
- `adapter`: under LoRA with the reference being the base model, the policy
  itself with its adapters disabled — one model in memory.
- `table`: `reference.precompute = true` — log-probs of every training
  sequence computed once in a batched pass before training, stored in the
  object store as a labeled `buffer` snapshot keyed by a digest of the
  reference model files, the tokenized data and the settings, and reused by
  any later run (or resume) with the same key. The reference model is never
  held during training. (Offline data only: RL samples change every step.)

DPO/KTO score whole sequences (`Reference.logps`); GRPO/PPO score every
completion token (`Reference.token_logps`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollout.errors import AlgorithmError
from rollout.models.load import ModelSource, load_model
from rollout.models.prefix import PrefixBatch, eval_mode, frozen_prefix_logps, rows_logps
from rollout.run import RunContext
from rollout.snapshots import Blob, commit_snapshot, read_snapshot_blob

TABLE_LABEL = "reference_logps:"


@dataclass
class Reference:
    """Computes reference log-prob sums (and token counts) for a TokenBatch."""

    kind: str  # "copy" | "adapter" | "table"
    model: Any = None  # the frozen copy, or the policy itself for "adapter"
    table: Any = None  # [num_sequences] float64 log-prob sums, for "table"
    snapshot_id: str | None = None

    def logps(self, tokens: Any, seq_ids: Sequence[int], *, shared: Any = None) -> Any:
        """[rows] reference log-prob sums for `tokens`, whose rows are sequences `seq_ids` (table).
        `shared`: the same rows as a PrefixBatch, which runs each prompt once."""
        if self.kind == "table":
            return self.table[torch.as_tensor(list(seq_ids))].to(torch.float32)
        guard = self.model.disable_adapter() if self.kind == "adapter" else nullcontext()
        with eval_mode(self.model), torch.no_grad(), guard:
            logps, _ = rows_logps(self.model, tokens, shared)
        return logps.float()

    def token_logps(self, rows: PrefixBatch, *, temperature: float = 1.0) -> Any:
        """[B, Lc] reference log-probs of every completion token of `rows` (a model reference only),
        under softmax(logits / temperature) like the policy's."""
        return frozen_prefix_logps(self.model, rows, adapter_disabled=self.kind == "adapter",
                                   temperature=temperature)


def build_model_reference(
    policy: Any, *, base: ModelSource, reference_uri: str | None, lora: bool, pad_token_id: int, device: Any,
    seed: int,
) -> Reference:
    """A reference that runs a model: the adapter-disabled policy under LoRA (when the reference is
    the base model), else a frozen copy of `reference_uri` (default: the base model)."""
    uri = reference_uri or base.uri
    if lora and uri == base.uri:
        return Reference(kind="adapter", model=policy)
    return Reference(kind="copy", model=_frozen_copy(base, uri, pad_token_id, device, seed))


def build_reference(
    ctx: RunContext,
    policy: Any,
    *,
    base: ModelSource,
    reference_uri: str | None,
    precompute: bool,
    lora: bool,
    pad_token_id: int,
    device: Any,
    seed: int,
    precompute_fn: Callable[[Reference], Any],
    data_digest: str,
) -> Reference:
    """Pick and build the reference. `precompute_fn(ref)` returns the whole table
    ([num_sequences] log-prob sums, in the order the algorithm indexes it)."""
    uri = reference_uri or base.uri
    shares_base = uri == base.uri
    if precompute:
        return _table(ctx, policy, base=base, uri=uri, lora=lora and shares_base, pad_token_id=pad_token_id,
                      device=device, seed=seed, precompute_fn=precompute_fn, data_digest=data_digest)
    return build_model_reference(policy, base=base, reference_uri=reference_uri, lora=lora,
                                 pad_token_id=pad_token_id, device=device, seed=seed)


def _frozen_copy(base: ModelSource, uri: str, pad_token_id: int, device: Any, seed: int) -> Any:
    model = load_model(replace(base, uri=uri), task="causal_lm", pad_token_id=pad_token_id, seed=seed).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _table(
    ctx: RunContext, policy: Any, *, base: ModelSource, uri: str, lora: bool, pad_token_id: int,
    device: Any, seed: int, precompute_fn: Callable[[Reference], Any], data_digest: str,
) -> Reference:
    # A resumed run uses exactly the table its snapshot was trained against.
    if ctx.resume_from is not None:
        table_id = ctx.resume_from.manifest.get("extra", {}).get("reference_table")
        if table_id:
            record = ctx.store.get_snapshot(table_id)
            table = load_safetensors(read_snapshot_blob(ctx.objects, record, "logps"))["logps"]
            ctx.recorder.event("reference_reused", snapshot_id=record.id, reason="resume")
            return Reference(kind="table", table=table, snapshot_id=record.id)

    key = blake3.blake3(
        json.dumps({"format": 1, "model": model_digest(uri), "dtype": base.dtype, "data": data_digest},
                   sort_keys=True).encode()
    ).hexdigest()
    label = TABLE_LABEL + key
    for record in ctx.store.list_snapshots(kind="buffer"):
        if record.label == label:
            table = load_safetensors(read_snapshot_blob(ctx.objects, record, "logps"))["logps"]
            ctx.recorder.event("reference_reused", snapshot_id=record.id, reason="same model and data")
            return Reference(kind="table", table=table, snapshot_id=record.id)
    ctx.dist.barrier()  # under torchrun: every rank has looked before rank 0 stores a new table

    computer = Reference(kind="adapter", model=policy) if lora else Reference(
        kind="copy", model=_frozen_copy(base, uri, pad_token_id, device, seed)
    )
    out = precompute_fn(computer).detach().double().cpu().contiguous()
    if not torch.isfinite(out).all():
        raise AlgorithmError("reference log-probs contain NaN or inf")
    snapshot_id = ""
    if ctx.dist.is_rank0:  # every rank computed the same table; rank 0 stores it
        snapshot_id = commit_snapshot(
            ctx.store, ctx.objects, run_id=ctx.run.id, kind="buffer", step=0, label=label,
            blobs={"logps": Blob(data=save_safetensors({"logps": out.contiguous()}),
                                 meta={"tensors": {"logps": {"dtype": "float64", "shape": list(out.shape)}}})},
            extra={"content": "reference_logps", "reference_model": uri, "data_digest": data_digest},
        ).id
        ctx.recorder.event("reference_precomputed", snapshot_id=snapshot_id, sequences=int(out.shape[0]))
    snapshot_id = ctx.dist.broadcast_text(snapshot_id)
    del computer
    return Reference(kind="table", table=out, snapshot_id=snapshot_id)


def model_digest(uri: str) -> str:
    """blake3 over a local model folder's files (names + contents); the uri itself for hub ids."""
    path = Path(uri)
    if not path.is_dir():
        return blake3.blake3(uri.encode()).hexdigest()
    h = blake3.blake3()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def digest_records(records: Sequence[Any], *, extra: dict[str, Any] | None = None) -> str:
    """Digest of tokenized records (frozen dataclasses of ids/masks), for the table key."""
    h = blake3.blake3(json.dumps(extra or {}, sort_keys=True).encode())
    for r in records:
        h.update(json.dumps(dataclasses.asdict(r), sort_keys=True, default=int).encode() + b"\n")
    return h.hexdigest()
