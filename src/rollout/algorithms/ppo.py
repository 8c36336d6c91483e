"""PPO with a learned value head, GAE and a KL penalty folded into the reward.

    rollout train ppo --config examples/ppo-tiny.toml           # CPU, ~2 minutes

Schulman et al. (2017); the RLHF form of Ziegler et al. (2019) / Ouyang et al.
(2022). Each step, top to bottom:
  sample    `minibatch_size` prompts × `num_generations` completions
  score     reward functions / env → one scalar per completion
  evaluate  old log-probs, reference log-probs, old values (no grad)
  advantage per-token reward = −kl_coef·(log π − log π_ref), + score at the last token;
            GAE(γ, λ); whitening over the batch
  train     `num_iterations` optimizer steps of clipped policy + clipped value loss
            (after each: a config's `[eval]` on the policy, when due)
  sync      push the policy's weights to the engine; snapshot
Under `[distributed] kind = "ray"` rollout worker actors sample and score the groups
(`rollout.rl.ray_rollout`); everything else stays in this process, or in Ray learner actors
(`num_learners` > 1, `rollout.rl.ray_learners`), which get learner 0's rounds. Under
`kind = "torchrun"` (DDP) each rank samples its share of every round and the ranks exchange
them, as GRPO's do (`rollout.rl.torchrun_rollout`). Either way every rank then evaluates the
whole batch (old log-probs, values, reference, GAE and whitening: the same numbers on each) and
trains on its slice of every micro-batch, the gradients summed over the ranks
(`rollout.distributed`).
The value model is the base model with a scalar head on every position (a
`…ForSequenceClassification` whose score layer is applied per token); policy
and value train together under one optimizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from rollout.algorithms.config import PPOConfig
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
from rollout.distributed import Distributed, build_backend
from rollout.errors import AlgorithmError
from rollout.inference.types import SamplingParams
from rollout.losses.ppo import compute_gae, kl_penalized_rewards, ppo_loss_terms, whiten
from rollout.models.load import ModelSource, hf_model, load_model, load_tokenizer, load_trainable
from rollout.models.prefix import collate_prefix, frozen_prefix_logps, prefix_logps, prefix_outputs
from rollout.progress import TrainProgress
from rollout.rl.buffer import DataBuffer
from rollout.rl.manager import GroupSpec, RolloutManager
from rollout.rl.ray_rollout import build_rollout_engine
from rollout.rl.torchrun_rollout import rank_share
from rollout.rl.types import Sample
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

POLICY = "policy."


@dataclass(frozen=True)
class PPOBatch:
    rows: Any  # PrefixBatch: each prompt once, completions on top; [B, Lc] tensors are completion-major
    old_logps: Any
    old_values: Any
    advantages: Any
    returns: Any


def train_ppo(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    s = settings_for(cfg, PPOConfig)
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, s))


def _policy_and_value(policy: Any, value: Any) -> Any:
    class PolicyAndValue(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy, self.value = policy, value

    return PolicyAndValue()


def prefix_values(value_model: Any, rows: Any) -> Any:
    """[B, Lc]: column j holds V(prompt, completion < j), the value before completion token j."""
    base = hf_model(value_model)
    hidden = prefix_outputs(base.base_model, rows, "last_hidden_state", base.config)
    return base.score(hidden).squeeze(-1).float()


def turn_reward_tensor(samples: list[Sample], width: int) -> torch.Tensor:
    """[B, width]: each sample's turn rewards at its turns' last sampled tokens (a single-turn
    sample: its reward at its last token), zero elsewhere."""
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for row, sample in enumerate(samples):
        rewards = sample.turn_rewards or (float(sample.reward or 0.0),)
        for end, reward in zip(sample.turn_ends, rewards, strict=True):
            out[row, end] += reward
    return out


def make_ppo_loss_fn(s: PPOConfig, normalizer: float) -> Any:
    def loss_fn(model: Any, b: PPOBatch) -> tuple[Any, dict[str, Any]]:
        logps, entropy = prefix_logps(model.policy, b.rows, with_entropy=True, temperature=s.temperature)
        values = prefix_values(model.value, b.rows)
        mask = b.rows.target_mask
        loss, metrics = ppo_loss_terms(  # tensors, read back by the backend after the backward
            logps, b.old_logps, b.advantages, values, b.old_values, b.returns, mask,
            clip_ratio=s.clip_ratio, clip_value=s.clip_value, vf_coef=s.vf_coef, normalizer=normalizer,
        )
        metrics["entropy_sum"] = torch.where(mask, entropy.detach(), 0.0).sum()
        return loss, metrics

    return loss_fn


async def _train(ctx: RunContext, s: PPOConfig) -> TrainResult:
    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)
    if s.budget.max_steps is None:
        raise AlgorithmError("ppo needs budget.max_steps (epochs and tokens are not defined for sampled data)")
    total_steps = s.budget.max_steps

    base_model = ModelSource(**s.base_model.model_dump())
    tokenizer = load_tokenizer(base_model)
    pad_id = tokenizer.pad_token_id
    rows, report = read_rows_prepared(s.dataset, "prompt", model=s.base_model)
    data = [r.data for r in rows]
    device = pick_device(cfg.backend.device)
    reward_fns = resolve_reward_specs(s.rewards, s.env, ctx=ctx, device=device, dtype=s.base_model.dtype)
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                              tempered_logprobs=True)  # the trained distribution: softmax(logits / T)
    group = GroupSpec(s.num_generations, sampling, cfg.seed, s.reward_timeout_s)
    rollout_engine = build_rollout_engine(  # this process's engine, or Ray rollout workers
        cfg, base_model, group=group,
        rewards=s.rewards, env=s.env, device=device, weights_dir=ctx.run_dir / "weights", run_id=ctx.run.id,
        on_event=lambda name, fields: rec.event(name, **fields), rank=ctx.dist.rank,
    )
    episodes = episode_setup(s.env, tokenizer)
    group_runner = rank_group_runner(rollout_engine, ctx.dist, group, reward_fns=reward_fns, episodes=episodes)
    manager = RolloutManager(
        rollout_engine.sampler, data, DataBuffer(len(data), seed=cfg.seed), reward_fns=reward_fns, group=group,
        prompts_per_batch=s.minibatch_size, max_staleness=s.max_staleness,
        on_event=lambda name, fields: rec.event(name, **fields), episodes=episodes, group_runner=group_runner,
    )

    policy = load_trainable(
        base_model, task="causal_lm", pad_token_id=pad_id, seed=cfg.seed, device=device,
        lora=s.lora.model_dump() if s.lora else None,
    )
    value = load_model(base_model, task="reward", pad_token_id=pad_id, seed=cfg.seed + 1)
    model = _policy_and_value(policy, value).to(device)
    ref = build_model_reference(
        policy, base=base_model, reference_uri=s.reference.uri, lora=s.lora is not None, pad_token_id=pad_id,
        device=device, seed=cfg.seed,
    ) if s.kl_coef > 0 else None
    groups = None
    if s.value_lr is not None:  # the value model learns at its own rate; the schedule scales both
        groups = [{"params": list(policy.parameters())}, {"params": list(value.parameters()), "lr": s.value_lr}]
    backend = build_backend(  # the torch backend, under DDP with torchrun
        model, ctx.dist, device=device, total_steps=total_steps, max_grad_norm=s.max_grad_norm,
        optimizer=s.optimizer.model_dump(), scheduler=s.scheduler.model_dump(), param_groups=groups,
    )
    static_blobs = model_file_blobs(policy, tokenizer)
    loop = await restore_or_start(ctx, backend)
    source = BatchSource(manager, rollout_engine.weight_sync, pipelined=s.off_policy_steps == 1)
    version = source.restore(loop) if ctx.resume_from is not None else 0
    shared, weight_copies = set_up_rollout_engine(
        rollout_engine, policy, pipelined=source.pipelined, lora=s.lora is not None,
        distributed=ctx.dist.active, max_completion=max_completion_tokens(s.max_tokens, s.env),
    )

    extra = snapshot_extra(cfg, model_class="causal_lm", policy_prefix=POLICY)
    rec.event("train_start", algorithm="ppo", total_steps=total_steps, start_step=loop.step, device=str(device),
              num_prompts=len(data), num_skipped_lines=report.num_skipped, rewards=[n for n, _, _ in reward_fns],
              engine_shares_weights=shared, engine_weight_copies=weight_copies, resumed_from=ctx.resume_from.id if ctx.resume_from else None)

    last: dict[str, float] = {}
    empty_streak = 0
    try:
        with TrainProgress("ppo", total_steps, start=loop.step) as progress:
            while loop.step < total_steps:
                batch = await source.next(await _policy_export(backend)(), version)
                empty_streak = require_samples(batch, loop.step + 1, empty_streak)
                if empty_streak:
                    continue
                t_train = time.perf_counter()
                samples = list(batch.ok_samples())
                rows = collate_prefix([x.prompt_token_ids for x in samples],
                                      [x.completion_token_ids for x in samples], pad_id,
                                      [x.completion_mask for x in samples]).to(device)
                mask = rows.target_mask
                with torch.no_grad():
                    model.eval()
                    old_logps = frozen_prefix_logps(policy, rows, temperature=s.temperature)
                    old_values = prefix_values(value, rows) * mask
                    ref_logps = ref.token_logps(rows, temperature=s.temperature) if ref is not None else old_logps
                    model.train()
                    if any(x.turn_rewards for x in samples):
                        # Multi-turn: each turn's reward at that turn's last sampled token.
                        token_rewards = kl_penalized_rewards(
                            torch.zeros(len(samples), device=device), old_logps, ref_logps, mask, kl_coef=s.kl_coef
                        ) + turn_reward_tensor(samples, mask.shape[1]).to(device)
                    else:
                        scores = torch.tensor([x.reward for x in samples], dtype=torch.float32, device=device)
                        token_rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, kl_coef=s.kl_coef)
                    advantages, returns = compute_gae(token_rewards, old_values, mask, gamma=s.gamma, lam=s.lam)
                    if s.whiten_advantages and int(mask.sum()) >= 2:
                        advantages = whiten(advantages, mask)
                rows_ = list(range(len(samples)))
                chunks = [c for c in (rows_[i :: s.gradient_accumulation] for i in range(s.gradient_accumulation)) if c]
                micro = [_micro_batch(rows, c, old_logps, old_values, advantages, returns, ctx.dist) for c in chunks]
                normalizer = float(mask.sum())
                loss_fn = make_ppo_loss_fn(s, normalizer)
                for _ in range(s.num_iterations):
                    if loop.step >= total_steps:
                        break
                    agg: dict[str, float] = {}
                    for m in micro:
                        for k, v in (await backend.forward_backward(m, loss_fn)).items():
                            agg[k] = agg.get(k, 0.0) + v
                    result = await backend.optim_step()
                    if ctx.dist.active:  # every rank's sums (each counted its own slice)
                        agg = dict(zip(sorted(agg), ctx.dist.sum([agg[k] for k in sorted(agg)]), strict=True))
                    loop.step += 1
                    step_tokens = rows.num_row_tokens
                    loop.tokens_seen += step_tokens
                    n = max(1.0, agg["num_tokens"])
                    last = {
                        "train/loss": agg["loss_sum"] / normalizer, "train/policy_loss": agg["policy_loss_sum"] / n,
                        "train/value_loss": agg["value_loss_sum"] / n, "train/clip_frac": agg["clipped_tokens"] / n,
                        "train/value_clip_frac": agg["value_clipped_tokens"] / n, "train/approx_kl": agg["approx_kl_sum"] / n,
                        "train/entropy": agg["entropy_sum"] / n, "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                        "train/kl_to_ref": float(((old_logps - ref_logps) * mask).sum() / max(1, int(mask.sum()))),
                        "rollout/staleness": float(version - batch.policy_version),
                        "perf/generation_wait_s": source.gen_wait_s,
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
                    await evaluate_if_due(ctx, loop.step, policy, tokenizer)
                version += 1
                if snapshot_due(s.snapshot.every_steps, loop.step, total_steps, steps_taken=s.num_iterations):
                    await snapshot_rl(ctx, backend, source, loop, version, static_blobs, extra)
        await snapshot_rl(ctx, backend, source, loop, version, static_blobs, extra)
        await source.finish(_policy_export(backend), version)
    finally:
        await source.close()
        rollout_engine.close()
    return await finish_training(ctx, backend, policy, tokenizer, loop, export_dir=s.export.dir if s.export else None,
                                 static_blobs=static_blobs, extra=extra, metrics=last)


def _micro_batch(rows: Any, idx: list[int], old_logps: Any, old_values: Any, advantages: Any, returns: Any,
                 dist: Distributed) -> PPOBatch:
    """Rows `idx` of the evaluated batch; under torchrun this rank's contiguous share of them. Every
    rank must run a forward/backward per micro-batch (DDP's all-reduce), so a rank whose share is
    empty (fewer rows than ranks) takes the first row with no token counted."""
    counted = True
    if dist.active:
        share = rank_share(len(idx), dist.rank, dist.world_size)
        counted = share.stop > share.start
        idx = idx[share.start : share.stop] if counted else idx[:1]
    selected = rows.select(idx)
    if not counted:
        selected = dataclasses.replace(selected, loss_mask=torch.zeros_like(selected.target_mask))
    return PPOBatch(selected, old_logps[idx], old_values[idx], advantages[idx], returns[idx])


def _policy_export(backend: Any) -> Any:
    """An async callable: the policy's weights, named as the plain causal LM names them."""

    async def export() -> dict[str, Any]:
        weights = await backend.export_weights()
        return {k.removeprefix(POLICY): v for k, v in weights.items() if k.startswith(POLICY)}

    return export
