"""Direct preference optimisation: sigmoid (DPO), ipo, hinge, robust.

    rollout train dpo --config examples/dpo-tiny.toml           # CPU, ~1 minute

Rafailov et al. (2023). Each micro-batch holds B pairs as 2B rows (chosen
then rejected) scored in one forward pass; the reference log-probs come from
`rollout.algorithms.reference` (frozen copy, adapter-disabled policy under
LoRA, or a precomputed table). Prompt tokens are excluded from the log-probs.
For `ipo` the log-probs are averaged over completion tokens (Azar et al.,
2023), as TRL does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.algorithms.config import DPOConfig
from rollout.algorithms.reference import Reference, build_reference, digest_records
from rollout.algorithms.registry import TrainResult
from rollout.backends.torch_backend import move_to, pick_device
from rollout.checkpoint import model_file_blobs, snapshot_due
from rollout.config import RunConfig
from rollout.data.collate import collate_pairs
from rollout.data.jsonl import Row
from rollout.data.loader import MicroBatchPlan, iterate_micro_batches
from rollout.data.prepared import read_encoded
from rollout.data.tokenize import cut_pairs, tokenize_pairs
from rollout.distributed import build_backend
from rollout.errors import AlgorithmError
from rollout.losses.logps import sequence_logps
from rollout.losses.preference import dpo_loss
from rollout.models.load import ModelSource, load_tokenizer, load_trainable
from rollout.models.prefix import collate_shared_pairs, rows_logps
from rollout.progress import TrainProgress
from rollout.run import (
    RunContext,
    evaluate_if_due,
    finish_training,
    prepare_process,
    resolve_total_steps,
    restore_or_start,
    run_lifecycle,
    settings_for,
    snapshot_backend,
    snapshot_extra,
)


@dataclass(frozen=True)
class DPOBatch:
    tokens: Any  # TokenBatch: rows 0..n-1 chosen, n..2n-1 rejected; None when `shared` holds them
    num_pairs: int
    ref_logps: Any  # [2n] reference log-prob sums (averaged for ipo)
    shared: Any = None  # the same rows as a PrefixBatch (each prompt once), when the pairs allow it

    @property
    def num_tokens(self) -> int:
        """Tokens of the rows as full sequences (prompt + answer each), whichever form they are in."""
        return self.shared.num_row_tokens if self.tokens is None else self.tokens.num_tokens


def train_dpo(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    s = settings_for(cfg, DPOConfig)
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, s))


def make_dpo_loss_fn(s: DPOConfig, normalizer: float) -> Any:
    def loss_fn(model: Any, batch: DPOBatch) -> tuple[Any, dict[str, float]]:
        logps, counts = rows_logps(model, batch.tokens, batch.shared)
        if s.loss_type == "ipo":
            logps = logps / counts.clamp(min=1)
        n = batch.num_pairs
        return dpo_loss(
            logps[:n], logps[n:], batch.ref_logps[:n], batch.ref_logps[n:], beta=s.beta,
            loss_type=s.loss_type, label_smoothing=s.label_smoothing, normalizer=normalizer,
        )

    return loss_fn


def reference_logps(
    ref: Reference, tokens: Any, pair_ids: Sequence[int], num_pairs_total: int, *, average: bool, shared: Any = None
) -> Any:
    """[2n] reference log-probs for a pair batch (table rows: chosen 0..N-1, rejected N..2N-1).
    `tokens` may be None when `shared` holds the rows."""
    seq_ids = [*pair_ids, *(num_pairs_total + i for i in pair_ids)]
    logps = ref.logps(tokens, seq_ids, shared=shared)
    if average and ref.kind != "table":  # the table already stores averaged values for ipo
        counts = (shared.target_mask.sum(1) if tokens is None else tokens.loss_mask[:, 1:].sum(dim=1)).clamp(min=1)
        logps = logps / counts.to(logps.dtype)
    return logps


def collate_pair_batch(pairs: Sequence[Any], pad_id: int, device: Any) -> tuple[Any, int, Any]:
    """(full rows as collate_pairs makes them, number of pairs, the same rows sharing each prompt),
    on `device`: the shared rows when every pair's sides start with the same prompt tokens (the full
    rows are then None: nothing reads them), else the full rows (shared None)."""
    shared = collate_shared_pairs(pairs, pad_id)
    if shared is not None:
        return None, len(pairs), shared.to(device)
    tokens, n = collate_pairs(pairs, pad_id)
    return move_to(tokens, device), n, None


def precompute_pair_table(ref: Reference, pairs: Sequence[Any], pad_id: int, device: Any, *, average: bool) -> Any:
    """All pairs' reference log-probs in one batched pass: [2N] (chosen then rejected)."""
    n = len(pairs)
    table = torch.empty(2 * n, dtype=torch.float64)
    for start in range(0, n, 64):
        chunk = pairs[start : start + 64]
        tokens, c, shared = collate_pair_batch(chunk, pad_id, device)
        logps = reference_logps(ref, tokens, list(range(c)), 0, average=average, shared=shared).double().cpu()
        table[start : start + c] = logps[:c]
        table[n + start : n + start + c] = logps[c:]
    return table


async def _train(ctx: RunContext, s: DPOConfig) -> TrainResult:
    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)
    average = s.loss_type == "ipo"

    # ---- data
    base_model = ModelSource(**s.base_model.model_dump())
    tokenizer = load_tokenizer(base_model)
    pad_id = tokenizer.pad_token_id
    rows, report, encoded = read_encoded(s.dataset, "preference", tokenizer, model=s.base_model)
    pairs, stats, _ = cut_pairs(encoded, s.packing.max_seq_len)
    del rows, encoded  # the pairs are what training reads
    lengths = [max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
    plan = MicroBatchPlan(lengths, micro_batch_size=s.minibatch_size, packing="off",
                          max_seq_len=s.packing.max_seq_len, seed=cfg.seed)
    total_steps = resolve_total_steps(
        **s.budget.model_dump(), batches_per_epoch=plan.num_batches(0), grad_accum=s.gradient_accumulation,
        tokens_per_batch=2 * sum(lengths) / len(lengths) * s.minibatch_size,
    )

    # ---- policy, reference, optimizer
    device = pick_device(cfg.backend.device)
    model = load_trainable(
        base_model, task="causal_lm", pad_token_id=pad_id, seed=cfg.seed, device=device,
        lora=s.lora.model_dump() if s.lora else None,
    )
    ref = build_reference(
        ctx, model, base=base_model, reference_uri=s.reference.uri, precompute=s.reference.precompute,
        lora=s.lora is not None, pad_token_id=pad_id, device=device, seed=cfg.seed,
        precompute_fn=lambda r: precompute_pair_table(r, pairs, pad_id, device, average=average),
        data_digest=digest_records(pairs, extra={"average": average, "algorithm": "dpo"}),
    )
    backend = build_backend(  # the torch backend, under FSDP2 or DDP with torchrun
        model, ctx.dist, device=device, total_steps=total_steps, max_grad_norm=s.max_grad_norm,
        optimizer=s.optimizer.model_dump(), scheduler=s.scheduler.model_dump(),
    )
    static_blobs = model_file_blobs(model, tokenizer)
    loop = await restore_or_start(ctx, backend)

    extra = snapshot_extra(cfg, model_class="causal_lm", reference=ref.kind, reference_table=ref.snapshot_id)
    rec.event(
        "train_start", algorithm="dpo", total_steps=total_steps, start_step=loop.step, device=str(device),
        num_pairs=len(pairs), num_truncated=stats.num_truncated, num_skipped_lines=report.num_skipped,
        reference=ref.kind, resumed_from=ctx.resume_from.id if ctx.resume_from else None,
    )

    stream = iterate_micro_batches(plan, loop.cursor)
    last: dict[str, float] = {}
    with TrainProgress("dpo", total_steps, start=loop.step) as progress:
        while loop.step < total_steps and (s.budget.max_tokens is None or loop.tokens_seen < s.budget.max_tokens):
            t0 = time.perf_counter()
            batches = []
            for _ in range(s.gradient_accumulation):
                loop.cursor, rows_ = next(stream)
                idx = [r[0].sample for r in ctx.dist.shard(rows_)]  # this rank's slice (all of it locally)
                tokens, n, shared = collate_pair_batch([pairs[i] for i in idx], pad_id, device)
                ref_lp = reference_logps(ref, tokens, idx, len(pairs), average=average, shared=shared)
                batches.append(DPOBatch(tokens=tokens, num_pairs=n, ref_logps=ref_lp.to(device), shared=shared))
            normalizer = ctx.dist.sum([sum(b.num_pairs for b in batches)])[0]  # every rank's pairs
            loss_fn = make_dpo_loss_fn(s, normalizer)
            agg: dict[str, float] = {}
            for b in batches:
                for k, v in (await backend.forward_backward(b, loss_fn)).items():
                    agg[k] = agg.get(k, 0.0) + v
            result = await backend.optim_step()
            loop.step += 1
            names = sorted(agg)
            *sums, step_tokens = ctx.dist.sum([*(agg[k] for k in names), sum(b.num_tokens for b in batches)])
            agg, step_tokens = dict(zip(names, sums, strict=True)), int(step_tokens)
            loop.tokens_seen += step_tokens
            dt = time.perf_counter() - t0
            loss = agg["loss_sum"] / normalizer
            if loss != loss:
                raise AlgorithmError(f"step {loop.step}: loss is NaN (lr or beta too high?)")
            last = {
                "train/loss": loss,
                "rewards/chosen": agg["reward_chosen_sum"] / normalizer,
                "rewards/rejected": agg["reward_rejected_sum"] / normalizer,
                "rewards/margins": agg["margin_sum"] / normalizer,
                "rewards/accuracy": agg["correct"] / normalizer,
                "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                "perf/tokens_per_s": step_tokens / dt, "perf/steps_per_s": 1.0 / dt,
                "train/tokens_seen": float(loop.tokens_seen),
            }
            rec.metrics(loop.step, last)
            rec.event("train_step", step=loop.step, loss=loss, margin=last["rewards/margins"],
                      accuracy=last["rewards/accuracy"], lr=result.lr, grad_norm=result.grad_norm)
            progress.update(loop.step, {"loss": loss, "margin": last["rewards/margins"], "tok/s": round(step_tokens / dt)})
            await evaluate_if_due(ctx, loop.step, model, tokenizer)
            if snapshot_due(s.snapshot.every_steps, loop.step, total_steps):
                await snapshot_backend(
                    ctx, backend, step=loop.step, loop_state=loop.to_dict(), static_blobs=static_blobs, extra=extra
                )

    return await finish_training(
        ctx, backend, model, tokenizer, loop, export_dir=s.export.dir if s.export else None,
        static_blobs=static_blobs, extra=extra, metrics=last,
    )


def implicit_reward_accuracy(
    policy: Any, reference: Any, tokenizer: Any, rows: Sequence[Any], *, beta: float, max_seq_len: int,
    batch_size: int = 64,
) -> tuple[float, float]:
    """(accuracy, mean margin) of DPO's implicit reward β·(log π − log π_ref) on preference rows."""
    rows = [r if isinstance(r, Row) else Row(line=i + 1, data=r) for i, r in enumerate(rows)]
    pairs, _ = tokenize_pairs(rows, tokenizer, max_seq_len=max_seq_len)
    correct, margin_sum = 0, 0.0
    policy.eval()
    reference.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            tokens, n = collate_pairs(pairs[start : start + batch_size], tokenizer.pad_token_id)
            r = beta * (sequence_logps(policy, tokens)[0] - sequence_logps(reference, tokens)[0])
            margins = r[:n] - r[n:]
            correct += int((margins > 0).sum())
            margin_sum += float(margins.sum())
    return correct / max(1, len(pairs)), margin_sum / max(1, len(pairs))
