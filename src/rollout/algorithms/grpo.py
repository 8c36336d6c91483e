"""Group relative policy optimisation (and Dr. GRPO, DAPO, GSPO through settings).

    rollout train grpo --config examples/grpo-tiny.toml         # CPU, ~2 minutes

Shao et al. (2024). Each step, top to bottom:
  sample    `minibatch_size` prompts × `num_generations` completions from the engine
  score     reward functions / env (failures drop samples, counted)
  advantage group-normalised rewards (`scale_rewards`)
  train     `num_iterations` optimizer steps of the clipped surrogate (+ k3 KL when beta > 0),
            with truncated importance sampling against the engine's log-probs
            (after each: a config's `[eval]` on the trained policy, when due)
  sync      push the new weights to the engine
  snapshot  weights, optimizer, RNG, the manager's state and any batch generated ahead

Under `[distributed] kind = "torchrun"` each rank makes its share of every round's groups on its
own engine and the ranks exchange them (`rollout.rl.torchrun_rollout`), so every rank holds the
whole batch and computes the same advantages, normaliser and metrics; each micro-batch's rows are
then split over the ranks (`rank_rows`) and the gradients summed (FSDP2 / DDP,
`rollout.distributed`): a step is one process's step up to float reassociation. Ray learner
actors (`num_learners` > 1, `rollout.rl.ray_learners`) train the same way; learner 0's rollout
workers make every round and the others receive it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

from rollout.algorithms.config import GRPOConfig
from rollout.algorithms.reference import build_model_reference
from rollout.algorithms.registry import TrainResult
from rollout.algorithms.rl_common import (
    BatchSource,
    episode_setup,
    max_completion_tokens,
    rank_group_runner,
    require_samples,
    resolve_reward_specs,
    set_up_rollout_engine,
    snapshot_rl,
)
from rollout.backends.torch_backend import pick_device
from rollout.checkpoint import model_file_blobs, snapshot_due
from rollout.config import RunConfig
from rollout.data.prepared import read_rows_prepared
from rollout.distributed import Distributed, DistributedBackend, build_backend
from rollout.errors import AlgorithmError
from rollout.inference.types import SamplingParams
from rollout.losses.grpo import GRPO_METRICS, compute_group_advantages, grpo_loss_terms, grpo_normalizer
from rollout.models.load import ModelSource, load_tokenizer, load_trainable
from rollout.models.prefix import collate_prefix, frozen_prefix_logps, pad_rows, prefix_logps
from rollout.progress import TrainProgress
from rollout.rl.buffer import DataBuffer
from rollout.rl.episode import TRUNCATED
from rollout.rl.manager import GroupSpec, RolloutManager
from rollout.rl.ray_rollout import build_rollout_engine
from rollout.rl.torchrun_rollout import rank_share
from rollout.run import (
    RunContext,
    evaluate_if_due,
    finish_training,
    prepare_process,
    restore_or_start,
    run_lifecycle,
    settings_for,
    snapshot_extra,
)


@dataclass(frozen=True)
class GRPOBatch:
    rows: Any  # PrefixBatch: each prompt once, its completions on top (completion-major columns)
    advantages: Any  # [B]
    old_logps: Any  # [B, Lc] or None (one iteration per batch: the loss's detached log-probs)
    ref_logps: Any  # [B, Lc] or None
    rollout_logps: Any  # [B, Lc] the engine's log-probs of the sampled tokens


def train_grpo(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    s = settings_for(cfg, GRPOConfig)
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, s))


def make_grpo_loss_fn(s: GRPOConfig, normalizer: float) -> Any:
    def loss_fn(model: Any, batch: GRPOBatch) -> tuple[Any, dict[str, Any]]:
        logps, entropy = prefix_logps(model, batch.rows, with_entropy=True, temperature=s.temperature)
        mask = batch.rows.target_mask
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        loss, metrics = grpo_loss_terms(  # tensors, read back by the backend after the backward
            logps, old, batch.advantages, mask, clip_low=s.clip_low, clip_high=s.clip_high, beta=s.beta,
            ref_logps=batch.ref_logps, loss_agg=s.loss_agg, importance_sampling_level=s.importance_sampling_level,
            rollout_logps=batch.rollout_logps if s.tis_cap is not None else None, tis_cap=s.tis_cap,
            normalizer=normalizer,
        )
        metrics["entropy_sum"] = torch.where(mask, entropy.detach(), 0.0).sum()
        return loss, metrics

    return loss_fn


def collate_samples(samples: Any, idx: list[int], pad_id: int, weight: list[bool] | None = None) -> Any:
    """The PrefixBatch of samples `idx` (a row whose `weight` is False trains on no token)."""
    masks = [samples[i].completion_mask for i in idx]
    if weight is not None and not all(weight):
        masks = [m if w else (False,) * len(samples[i].completion_token_ids)
                 for i, m, w in zip(idx, masks, weight, strict=True)]
    return collate_prefix([samples[i].prompt_token_ids for i in idx],
                          [samples[i].completion_token_ids for i in idx], pad_id, masks)


def cut_short(sample: Any) -> bool:
    """Whether a completion stopped for want of room, not by itself: `max_tokens` reached, or an
    episode out of turns or tokens (`mask_truncated_completions`)."""
    return sample.finish_reason == "length" or sample.finish_reason in TRUNCATED


def inert_rows(s: GRPOConfig, advantages: Any, trained: list[bool], dist: Distributed) -> list[bool]:
    """Which rows can't change this step's gradient, so need no forward or backward pass: with
    `beta` = 0 a row whose advantage is exactly 0 (its group's rewards all equal) has a loss of
    exactly 0 at every token, through either clip branch, and so a zero gradient; a row with no
    trained token (`mask_truncated_completions`) has no loss at any `beta`. Leaving them out keeps
    the step's gradient: the normaliser still counts every row. verl's zero-advantage skip
    (verl-project/verl#5838) likewise; TRL runs them. One process only: under torchrun and Ray
    learner groups every rank runs every micro-batch's collectives. Nothing is inert when
    `skip_zero_advantage` is off."""
    if not s.skip_zero_advantage or dist.active:
        return [False] * len(trained)
    zero = (advantages == 0).tolist() if s.beta == 0 else [False] * len(trained)
    return [z or not t for z, t in zip(zero, trained, strict=True)]


def rank_rows(idx: list[int], dist: Distributed) -> tuple[list[int], list[bool]]:
    """This rank's contiguous share of a micro-batch's rows, and which of them count. Every rank
    must run a forward/backward per micro-batch (FSDP2 / DDP collectives), so a rank whose share
    is empty (fewer rows than ranks: a short batch) gets the first row with no token counted."""
    share = rank_share(len(idx), dist.rank, dist.world_size)
    mine = idx[share.start : share.stop]
    return (mine, [True] * len(mine)) if mine else ([idx[0]], [False])


def frozen_logps(backend: Any, model: Any, rows: Any, temperature: float) -> Any:
    """The current policy's log-probs of `rows` at `temperature` without grad: under FSDP2 through
    the wrapper (which gathers the sharded parameters), else from the model itself."""
    fn = functools.partial(frozen_prefix_logps, temperature=temperature)
    if isinstance(backend, DistributedBackend) and backend.dist.sharding == "fsdp":
        return backend.forward_frozen(rows, fn)
    return fn(model, rows)


def reduce_metrics(agg: dict[str, float], dist: Distributed) -> dict[str, float]:
    """The loss function's metrics summed over the ranks (`ratio_max`: the max)."""
    if not dist.active:
        return agg
    names = sorted(k for k in agg if k != "ratio_max")
    out = dict(zip(names, dist.sum([agg[k] for k in names]), strict=True))
    out["ratio_max"] = dist.max([agg["ratio_max"]])[0]
    return out


async def _train(ctx: RunContext, s: GRPOConfig) -> TrainResult:
    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)

    # ---- data, rewards, engine, manager
    base_model = ModelSource(**s.base_model.model_dump())
    tokenizer = load_tokenizer(base_model)
    rows, report = read_rows_prepared(s.dataset, "prompt", model=s.base_model)
    data = [r.data for r in rows]
    device = pick_device(cfg.backend.device)
    reward_fns = resolve_reward_specs(s.rewards, s.env, ctx=ctx, device=device, dtype=s.base_model.dtype)
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                              tempered_logprobs=True)  # the trained distribution: softmax(logits / T)
    group = GroupSpec(s.num_generations, sampling, cfg.seed, s.reward_timeout_s)
    rollout_engine = build_rollout_engine(
        cfg, base_model, group=group, rewards=s.rewards, env=s.env, device=device,
        weights_dir=ctx.run_dir / "weights", run_id=ctx.run.id, on_event=lambda name, fields: rec.event(name, **fields),
        rank=ctx.dist.rank,
    )
    episodes = episode_setup(s.env, tokenizer)
    group_runner = rank_group_runner(rollout_engine, ctx.dist, group, reward_fns=reward_fns, episodes=episodes)
    manager = RolloutManager(
        rollout_engine.sampler, data, DataBuffer(len(data), seed=cfg.seed), reward_fns=reward_fns, group=group,
        prompts_per_batch=s.minibatch_size, dynamic_filtering=s.dynamic_sampling,
        max_oversample_rounds=s.max_oversample_rounds, max_staleness=s.max_staleness,
        on_event=lambda name, fields: rec.event(name, **fields), episodes=episodes, group_runner=group_runner,
    )
    if s.budget.max_steps is None:
        raise AlgorithmError("grpo needs budget.max_steps (epochs and tokens are not defined for sampled data)")
    total_steps = s.budget.max_steps
    max_completion = max_completion_tokens(s.max_tokens, s.env)

    # ---- policy, reference, optimizer
    model = load_trainable(
        base_model, task="causal_lm", pad_token_id=tokenizer.pad_token_id, seed=cfg.seed, device=device,
        lora=s.lora.model_dump() if s.lora else None,
    )
    ref = build_model_reference(
        model, base=base_model, reference_uri=s.reference.uri, lora=s.lora is not None,
        pad_token_id=tokenizer.pad_token_id, device=device, seed=cfg.seed,
    ) if s.beta > 0 else None
    backend = build_backend(  # the torch backend, under FSDP2 or DDP with torchrun
        model, ctx.dist, device=device, total_steps=total_steps, max_grad_norm=s.max_grad_norm,
        optimizer=s.optimizer.model_dump(), scheduler=s.scheduler.model_dump(),
    )
    static_blobs = model_file_blobs(model, tokenizer)
    loop = await restore_or_start(ctx, backend)
    source = BatchSource(manager, rollout_engine.weight_sync, pipelined=s.off_policy_steps == 1)
    version = source.restore(loop) if ctx.resume_from is not None else 0
    shared, weight_copies = set_up_rollout_engine(
        rollout_engine, model, pipelined=source.pipelined, lora=s.lora is not None,
        distributed=ctx.dist.active, max_completion=max_completion,
    )

    extra = snapshot_extra(cfg, model_class="causal_lm")
    rec.event(
        "train_start", algorithm="grpo", total_steps=total_steps, start_step=loop.step, device=str(device),
        num_prompts=len(data), num_skipped_lines=report.num_skipped, rewards=[n for n, _, _ in reward_fns],
        pipelined=source.pipelined, engine_shares_weights=shared, engine_weight_copies=weight_copies,
        resumed_from=ctx.resume_from.id if ctx.resume_from else None,
    )

    pad_id = tokenizer.pad_token_id
    last: dict[str, float] = {}
    empty_streak = 0
    try:
        with TrainProgress("grpo", total_steps, start=loop.step) as progress:
            while loop.step < total_steps:
                # ---- sample + score (or take the batch generated during the last step)
                batch = await source.next(await backend.export_weights(), version)
                empty_streak = require_samples(batch, loop.step + 1, empty_streak)
                if empty_streak:
                    continue
                t_train = time.perf_counter()
                samples = [x for g in batch.groups() for x in g]
                # ---- advantages
                rewards = torch.tensor([x.reward for x in samples], dtype=torch.float32)
                advantages = compute_group_advantages(
                    rewards, torch.tensor([x.group_id for x in samples]), scale_rewards=s.scale_rewards
                )
                # ---- micro-batches with their fixed inputs
                chunks = [list(range(len(samples)))[i :: s.gradient_accumulation] for i in range(s.gradient_accumulation)]
                chunks = [c for c in chunks if c]
                # Old log-probs are the policy's before this batch's first optimizer step: with one
                # iteration that is the loss's own forward (detached), pipelined or not -- the batch's
                # staleness is the engine's log-probs' business (truncated IS). A second pass only
                # when later iterations need the first one's values, as TRL's `num_iterations`.
                reused = s.num_iterations > 1
                trained = [not (s.mask_truncated_completions and cut_short(x)) for x in samples]
                whole = [collate_samples(samples, idx, pad_id, [trained[i] for i in idx])  # the global micro-batches
                         for idx in chunks]
                masks = [rows.target_mask for rows in whole]
                # every completion masked (all cut short): a step with no loss, as TRL's clamp to 1
                normalizer = grpo_normalizer(s.loss_agg, masks, max_completion) if any(m.any() for m in masks) else 1.0
                step_tokens = sum(rows.num_row_tokens for rows in whole)
                # rows whose gradient is exactly zero are left out of the passes (`skip_zero_advantage`)
                inert = inert_rows(s, advantages, trained, ctx.dist)
                micro = []
                for idx, rows in zip(chunks, whole, strict=True):
                    if any(inert[i] for i in idx):
                        idx = [i for i in idx if not inert[i]]
                        if not idx:
                            continue
                        rows = collate_samples(samples, idx, pad_id, [trained[i] for i in idx])
                    if ctx.dist.active:  # this rank's rows of the micro-batch
                        idx, weight = rank_rows(idx, ctx.dist)
                        weight = [w and trained[i] for i, w in zip(idx, weight, strict=True)]
                        rows = collate_samples(samples, idx, pad_id, weight)
                    rows = rows.to(device)
                    rollout = pad_rows([samples[i].rollout_logprobs for i in idx],
                                       rows.completion_ids.shape[1]).to(device)
                    old = frozen_logps(backend, model, rows, s.temperature) if reused else None
                    ref_logps = ref.token_logps(rows, temperature=s.temperature) if ref is not None else None
                    micro.append(GRPOBatch(rows, advantages[idx].to(device), old, ref_logps, rollout))
                # ---- train: num_iterations optimizer steps on this batch
                loss_fn = make_grpo_loss_fn(s, normalizer)
                for _ in range(s.num_iterations):
                    if loop.step >= total_steps:
                        break
                    t0 = time.perf_counter()
                    agg = dict.fromkeys((*GRPO_METRICS, "entropy_sum"), 0.0)  # no pass (every row inert): no token
                    for m in micro:
                        for k, v in (await backend.forward_backward(m, loss_fn)).items():
                            agg[k] = max(agg[k], v) if k == "ratio_max" else agg[k] + v
                    if not micro:  # the loss's gradient is exactly zero: the step a backward of it leads to
                        await backend.zero_gradients()
                    result = await backend.optim_step()
                    agg = reduce_metrics(agg, ctx.dist)
                    loop.step += 1
                    loop.tokens_seen += step_tokens
                    n_tok = max(1.0, agg["num_tokens"])
                    last = {
                        "train/loss": agg["loss_sum"] / normalizer, "train/lr": result.lr,
                        "train/grad_norm": result.grad_norm, "train/clip_frac": agg["clipped_tokens"] / n_tok,
                        "train/kl": agg["kl_sum"] / n_tok, "train/entropy": agg["entropy_sum"] / n_tok,
                        "train/ratio_mean": agg["ratio_sum"] / n_tok, "train/ratio_max": agg["ratio_max"],
                        "train/is_weight_mean": agg["is_weight_sum"] / n_tok,
                        "train/skipped_frac": sum(inert) / len(samples),
                        "rollout/staleness": float(version - batch.policy_version),
                        "perf/generation_wait_s": source.gen_wait_s,
                        "perf/train_s": time.perf_counter() - t0,
                        "perf/tokens_per_s": step_tokens / max(1e-9, time.perf_counter() - t_train),
                        "train/tokens_seen": float(loop.tokens_seen),
                        **{k: float(v) for k, v in batch.metrics.items()},
                    }
                    if last["train/loss"] != last["train/loss"]:
                        raise AlgorithmError(f"step {loop.step}: loss is NaN")
                    rec.metrics(loop.step, last)
                    rec.event("train_step", step=loop.step, loss=last["train/loss"],
                              reward_mean=last.get("rollout/reward_mean"), lr=result.lr)
                    progress.update(loop.step, {"loss": last["train/loss"], "reward": last.get("rollout/reward_mean", 0.0),
                                                "tok/s": round(last["perf/tokens_per_s"])})
                    await evaluate_if_due(ctx, loop.step, model, tokenizer)
                version += 1
                # ---- snapshot at batch boundaries
                if snapshot_due(s.snapshot.every_steps, loop.step, total_steps, steps_taken=s.num_iterations):
                    await snapshot_rl(ctx, backend, source, loop, version, static_blobs, extra)
        await snapshot_rl(ctx, backend, source, loop, version, static_blobs, extra)
        await source.finish(backend.export_weights, version)
    finally:
        await source.close()
        rollout_engine.close()
    return await finish_training(ctx, backend, model, tokenizer, loop, export_dir=s.export.dir if s.export else None,
                                 static_blobs=static_blobs, extra=extra, metrics=last)

