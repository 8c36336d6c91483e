"""Reward model: Bradley–Terry on preference pairs.

    rollout train rm --config examples/rm-tiny.toml            # CPU, ~1 minute

A 1-logit head (`AutoModelForSequenceClassification`, so exports load in
transformers unchanged) scores the hidden state of the last non-pad token of
prompt+chosen and prompt+rejected; both halves of a micro-batch run in one
forward pass, each prompt once when the two sides share its tokens (its keys/values
gathered to both rows, `rollout.models.prefix`: the same scores up to float
rounding, ~40% fewer tokens on short answers). Loss and metrics:
`rollout.losses.rm.bradley_terry_loss`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.algorithms.config import RMConfig
from rollout.algorithms.registry import TrainResult
from rollout.backends.torch_backend import move_to, pick_device
from rollout.checkpoint import model_file_blobs, snapshot_due
from rollout.config import RunConfig
from rollout.data.collate import collate_pairs
from rollout.data.jsonl import Row
from rollout.data.loader import MicroBatchPlan, iterate_micro_batches
from rollout.data.prepared import read_encoded
from rollout.data.sources import read_dataset
from rollout.data.tokenize import cut_pairs, tokenize_pairs
from rollout.distributed import build_backend
from rollout.errors import AlgorithmError, DataError
from rollout.losses.rm import bradley_terry_loss
from rollout.models.lean_decoder import decoder_hidden_states
from rollout.models.load import ModelSource, hf_model, load_tokenizer, load_trainable
from rollout.models.prefix import PrefixBatch, collate_shared_pairs, prefix_last_hidden
from rollout.progress import TrainProgress
from rollout.run import (
    RunContext,
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
class PairBatch:
    tokens: Any  # TokenBatch: rows 0..n-1 chosen, n..2n-1 rejected
    num_pairs: int
    margins: Any  # [n] float tensor: per-line margins (0 where absent)
    shared: PrefixBatch | None = None  # the same rows with each prompt once, when the pairs allow it


def train_rm(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    s = settings_for(cfg, RMConfig)
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, s))


def score_sequences(model: Any, tokens: Any, shared: PrefixBatch | None = None) -> Any:
    """Scalar reward per row from the hidden state of its last non-pad token. [B]

    With `shared` (the same rows as a `PrefixBatch`), each distinct prompt runs once."""
    base = hf_model(model)
    if shared is not None:
        pooled = prefix_last_hidden(base.base_model, shared, base.config, model=base)
    else:
        hidden = decoder_hidden_states(base, base.base_model, tokens.input_ids, tokens.attention_mask)
        last = tokens.attention_mask.sum(dim=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return base.score(pooled).squeeze(-1).float()


def make_rm_loss_fn(normalizer: float, *, margin: float, center_coefficient: float | None) -> Any:
    def loss_fn(model: Any, batch: PairBatch) -> tuple[Any, dict[str, float]]:
        rewards = score_sequences(model, batch.tokens, batch.shared)
        n = batch.num_pairs
        return bradley_terry_loss(
            rewards[:n], rewards[n:], normalizer=normalizer,
            margin=batch.margins + margin, center_coefficient=center_coefficient,
        )

    return loss_fn


def collate_pair_batch(pairs: Sequence[Any], margins: Sequence[float], pad_id: int) -> PairBatch:
    tokens, n = collate_pairs(pairs, pad_id)
    return PairBatch(tokens=tokens, num_pairs=n, margins=torch.tensor(list(margins), dtype=torch.float32),
                     shared=collate_shared_pairs(pairs, pad_id))


def pair_accuracy(model: Any, tokenizer: Any, rows: Sequence[Any], *, max_seq_len: int, batch_size: int = 64) -> float:
    """Fraction of preference rows (`Row`s or dicts) whose chosen side scores higher."""
    rows = [r if isinstance(r, Row) else Row(line=i + 1, data=r) for i, r in enumerate(rows)]
    pairs, _ = tokenize_pairs(rows, tokenizer, max_seq_len=max_seq_len)
    correct = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            batch = collate_pair_batch(chunk, [0.0] * len(chunk), tokenizer.pad_token_id)
            device = next(model.parameters()).device
            rewards = score_sequences(model, move_to(batch.tokens, device), move_to(batch.shared, device))
            correct += int((rewards[: len(chunk)] > rewards[len(chunk) :]).sum())
    return correct / max(1, len(pairs))


async def _train(ctx: RunContext, s: RMConfig) -> TrainResult:
    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)

    # ---- data
    base_model = ModelSource(**s.base_model.model_dump())
    tokenizer = load_tokenizer(base_model)
    rows, report, encoded = read_encoded(s.dataset, "preference", tokenizer, model=s.base_model)
    pairs, stats, kept = cut_pairs(encoded, s.packing.max_seq_len)
    rows = [rows[i] for i in kept]  # a line's margin follows its pair
    del encoded
    margins = [_line_margin(r) for r in rows]
    eval_rows = read_dataset(s.eval_dataset, "preference")[0] if s.eval_dataset is not None else None
    lengths = [max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
    plan = MicroBatchPlan(lengths, micro_batch_size=s.minibatch_size, packing="off",
                          max_seq_len=s.packing.max_seq_len, seed=cfg.seed)
    if plan.num_batches(0) == 0:
        raise AlgorithmError(f"{report.label}: {len(pairs)} pairs make no full micro-batch of {s.minibatch_size}")
    total_steps = resolve_total_steps(
        **s.budget.model_dump(), batches_per_epoch=plan.num_batches(0), grad_accum=s.gradient_accumulation,
        tokens_per_batch=2 * sum(lengths) / len(lengths) * s.minibatch_size,
    )

    # ---- model, optimizer, schedule
    device = pick_device(cfg.backend.device)
    model = load_trainable(
        base_model, task="reward", pad_token_id=tokenizer.pad_token_id, seed=cfg.seed, device=device,
        lora=s.lora.model_dump() if s.lora else None,
    )
    backend = build_backend(  # the torch backend, under FSDP2 or DDP with torchrun
        model, ctx.dist, device=device, total_steps=total_steps, max_grad_norm=s.max_grad_norm,
        optimizer=s.optimizer.model_dump(), scheduler=s.scheduler.model_dump(),
    )
    static_blobs = model_file_blobs(model, tokenizer)

    # ---- restore
    loop = await restore_or_start(ctx, backend)

    extra = snapshot_extra(cfg, model_class="reward")
    rec.event(
        "train_start", algorithm="rm", total_steps=total_steps, start_step=loop.step, device=str(device),
        num_pairs=len(pairs), num_truncated=stats.num_truncated, num_skipped_lines=report.num_skipped,
        resumed_from=ctx.resume_from.id if ctx.resume_from else None,
    )

    stream = iterate_micro_batches(plan, loop.cursor)
    pad_id = tokenizer.pad_token_id
    last: dict[str, float] = {}
    budget_tokens = s.budget.max_tokens
    with TrainProgress("rm", total_steps, start=loop.step) as progress:
        while loop.step < total_steps and (budget_tokens is None or loop.tokens_seen < budget_tokens):
            t0 = time.perf_counter()
            batches = []
            for _ in range(s.gradient_accumulation):
                loop.cursor, rows_ = next(stream)
                idx = [r[0].sample for r in ctx.dist.shard(rows_)]  # this rank's slice (all of it locally)
                batches.append(collate_pair_batch([pairs[i] for i in idx], [margins[i] for i in idx], pad_id))
            normalizer = ctx.dist.sum([sum(b.num_pairs for b in batches)])[0]  # every rank's pairs
            loss_fn = make_rm_loss_fn(normalizer, margin=s.margin, center_coefficient=s.center_rewards_coefficient)
            agg: dict[str, float] = {}
            for b in batches:
                for k, v in (await backend.forward_backward(b, loss_fn)).items():
                    agg[k] = agg.get(k, 0.0) + v
            result = await backend.optim_step()
            loop.step += 1
            names = sorted(agg)
            *sums, step_tokens = ctx.dist.sum([*(agg[k] for k in names), sum(b.tokens.num_tokens for b in batches)])
            agg, step_tokens = dict(zip(names, sums, strict=True)), int(step_tokens)
            loop.tokens_seen += step_tokens
            dt = time.perf_counter() - t0
            loss = agg["loss_sum"] / normalizer
            if loss != loss:
                raise AlgorithmError(f"step {loop.step}: loss is NaN (lr too high?)")
            last = {
                "train/loss": loss, "train/accuracy": agg["correct"] / normalizer,
                "train/reward_chosen": agg["reward_chosen_sum"] / normalizer,
                "train/reward_rejected": agg["reward_rejected_sum"] / normalizer,
                "train/margin": (agg["reward_chosen_sum"] - agg["reward_rejected_sum"]) / normalizer,
                "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                "perf/tokens_per_s": step_tokens / dt, "train/tokens_seen": float(loop.tokens_seen),
            }
            rec.metrics(loop.step, last)
            rec.event("train_step", step=loop.step, loss=loss, accuracy=last["train/accuracy"], lr=result.lr,
                      grad_norm=result.grad_norm)
            progress.update(loop.step, {"loss": loss, "acc": last["train/accuracy"], "tok/s": round(step_tokens / dt)})
            if snapshot_due(s.snapshot.every_steps, loop.step, total_steps):
                await snapshot_backend(
                    ctx, backend, step=loop.step, loop_state=loop.to_dict(), static_blobs=static_blobs, extra=extra
                )

    if eval_rows is not None:  # the final weights: deterministic, no grad, after the last snapshot's state
        held_out = {"eval/pair_accuracy": pair_accuracy(model, tokenizer, eval_rows, max_seq_len=s.packing.max_seq_len)}
        rec.metrics(loop.step, held_out)
        last = {**last, **held_out}
    return await finish_training(
        ctx, backend, model, tokenizer, loop, export_dir=s.export.dir if s.export else None,
        static_blobs=static_blobs, extra=extra, metrics=last,
    )


def _line_margin(row: Row) -> float:
    value = row.data.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        where = row.location or f"line {row.line}"
        raise DataError(f'{where}: field "margin" must be a number, got {type(value).__name__}')
    return float(value)
