"""Supervised fine-tuning.

    rollout train sft --config examples/sft-tiny.toml          # CPU, ~1 minute
    rollout train sft --config examples/sft-tiny.toml --resume <snapshot-id>

The loop, top to bottom: load data → tokenize → plan micro-batches → load the
model → (restore) → for each step: collate, forward/backward each micro-batch
with the loss normalised by the step's target-token count, optimizer step,
log, eval (a config's `[eval]`, when due), snapshot. Cross-entropy is computed only at target positions (hidden
states are gathered before the LM head), which skips most of the vocabulary
projection when the loss is on completions only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout.algorithms.config import SFTConfig
from rollout.algorithms.registry import TrainResult
from rollout.backends.torch_backend import pick_device
from rollout.checkpoint import model_file_blobs, snapshot_due
from rollout.config import RunConfig
from rollout.data.collate import attention_mask_for, collate_packed, collate_padded
from rollout.data.loader import MicroBatchPlan, iterate_micro_batches
from rollout.data.prepared import read_encoded
from rollout.data.tokenize import cut_samples
from rollout.distributed import build_backend
from rollout.errors import AlgorithmError
from rollout.losses.sft import next_token_targets, sft_loss
from rollout.models.lean_decoder import decoder_hidden_states
from rollout.models.load import ModelSource, hf_model, load_tokenizer, load_trainable
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


def train_sft(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    s = settings_for(cfg, SFTConfig)
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, s))


def make_sft_loss_fn(normalizer: float) -> Any:
    """loss_fn(model, batch) for the backend: CE at target positions / normalizer."""
    def loss_fn(model: Any, batch: Any) -> tuple[Any, dict[str, float]]:
        base = hf_model(model)
        valid, targets = next_token_targets(batch.input_ids, batch.loss_mask, batch.position_ids)
        mask = attention_mask_for(batch, attn_implementation=base.config._attn_implementation, dtype=base.dtype)
        hidden = decoder_hidden_states(base, base.get_decoder(), batch.input_ids, mask, batch.position_ids)
        logits = base.get_output_embeddings()(hidden[:, :-1][valid])
        return sft_loss(logits, targets[valid], normalizer=normalizer)

    return loss_fn


def count_targets(batch: Any) -> int:
    valid, _ = next_token_targets(batch.input_ids, batch.loss_mask, batch.position_ids)
    return int(valid.sum())


async def _train(ctx: RunContext, s: SFTConfig) -> TrainResult:
    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)

    # ---- data
    base_model = ModelSource(**s.base_model.model_dump())
    tokenizer = load_tokenizer(base_model)
    rows, report, encoded = read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on=s.loss_on.kind)
    samples, stats, _ = cut_samples(encoded, s.packing.max_seq_len)
    del rows, encoded  # the samples are what training reads
    if not samples:
        raise AlgorithmError(f"{report.label}: no trainable samples after tokenization")
    plan = MicroBatchPlan(
        [len(x.input_ids) for x in samples], micro_batch_size=s.minibatch_size,
        packing=s.packing.kind, max_seq_len=s.packing.max_seq_len, seed=cfg.seed,
    )
    if plan.num_batches(0) == 0:
        raise AlgorithmError(
            f"{report.label}: {len(samples)} samples make no full micro-batch of {s.minibatch_size}"
        )
    mean_tokens = stats.num_tokens / max(1, stats.num_samples) * s.minibatch_size
    total_steps = resolve_total_steps(
        **s.budget.model_dump(), batches_per_epoch=plan.num_batches(0), grad_accum=s.gradient_accumulation,
        tokens_per_batch=mean_tokens,
    )

    # ---- model, optimizer, schedule
    device = pick_device(cfg.backend.device)
    model = load_trainable(
        base_model, task="causal_lm", pad_token_id=tokenizer.pad_token_id, seed=cfg.seed, device=device,
        lora=s.lora.model_dump() if s.lora else None,
    )
    backend = build_backend(  # the torch backend, under FSDP2 or DDP with torchrun
        model, ctx.dist, device=device, total_steps=total_steps, max_grad_norm=s.max_grad_norm,
        optimizer=s.optimizer.model_dump(), scheduler=s.scheduler.model_dump(),
    )
    static_blobs = model_file_blobs(model, tokenizer)

    # ---- restore
    loop = await restore_or_start(ctx, backend)

    extra = snapshot_extra(cfg, model_class="causal_lm")
    rec.event(
        "train_start", algorithm="sft", total_steps=total_steps, start_step=loop.step, device=str(device),
        num_samples=stats.num_samples, num_truncated=stats.num_truncated, num_dropped=stats.num_dropped,
        num_skipped_lines=report.num_skipped, resumed_from=ctx.resume_from.id if ctx.resume_from else None,
    )

    stream = iterate_micro_batches(plan, loop.cursor)
    pad_id = tokenizer.pad_token_id
    last: dict[str, float] = {}
    budget_tokens = s.budget.max_tokens
    with TrainProgress("sft", total_steps, start=loop.step) as progress:
        while loop.step < total_steps and (budget_tokens is None or loop.tokens_seen < budget_tokens):
            t0 = time.perf_counter()
            batches = []
            for _ in range(s.gradient_accumulation):
                loop.cursor, rows_ = next(stream)
                rows_ = ctx.dist.shard(rows_)  # this rank's slice of the global micro-batch (all of it locally)
                if s.packing.kind == "off":
                    batches.append(collate_padded([samples[r[0].sample] for r in rows_], pad_id))
                else:
                    batches.append(collate_packed(rows_, samples, pad_id))
            normalizer = int(ctx.dist.sum([sum(count_targets(b) for b in batches)])[0])  # every rank's targets
            if normalizer == 0:
                raise AlgorithmError(f"step {loop.step + 1}: no loss tokens in the batch (check loss_on)")
            loss_fn = make_sft_loss_fn(normalizer)
            loss_sum = 0.0
            for b in batches:
                loss_sum += (await backend.forward_backward(b, loss_fn))["loss_sum"]
            result = await backend.optim_step()
            loop.step += 1
            loss_sum, step_tokens = ctx.dist.sum([loss_sum, sum(b.num_tokens for b in batches)])
            step_tokens = int(step_tokens)
            loop.tokens_seen += step_tokens
            dt = time.perf_counter() - t0
            loss = loss_sum / normalizer
            if loss != loss:  # NaN
                raise AlgorithmError(f"step {loop.step}: loss is NaN (lr too high?)")
            last = {
                "train/loss": loss, "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                "perf/tokens_per_s": step_tokens / dt, "train/num_loss_tokens": float(normalizer),
                "train/tokens_seen": float(loop.tokens_seen),
            }
            rec.metrics(loop.step, last)
            rec.event("train_step", step=loop.step, loss=loss, lr=result.lr, grad_norm=result.grad_norm)
            progress.update(loop.step, {"loss": loss, "tok/s": round(step_tokens / dt)})
            await evaluate_if_due(ctx, loop.step, model, tokenizer)
            if snapshot_due(s.snapshot.every_steps, loop.step, total_steps):
                await snapshot_backend(
                    ctx, backend, step=loop.step, loop_state=loop.to_dict(), static_blobs=static_blobs, extra=extra
                )

    return await finish_training(
        ctx, backend, model, tokenizer, loop, export_dir=s.export.dir if s.export else None,
        static_blobs=static_blobs, extra=extra, metrics=last,
    )

