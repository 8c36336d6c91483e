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
  sync      push the policy's weights to the engine; snapshot
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

from rollout.algorithms.common import (
    RunContext,
    TrainProgress,
    TrainResult,
    build_torch_backend,
    finish_training,
    hf_model,
    load_model,
    load_tokenizer,
    load_trainable,
    model_file_blobs,
    prepare_process,
    restore_or_start,
    run_lifecycle,
    snapshot_extra,
)
from rollout.algorithms.rl_common import (
    BatchSource,
    build_engine,
    frozen_token_logps,
    require_samples,
    resolve_reward_specs,
    sample_sequences,
    snapshot_rl,
    token_logps,
)
from rollout.config import PPOConfig, RunConfig
from rollout.errors import AlgorithmError

POLICY = "policy."


@dataclass(frozen=True)
class PPOBatch:
    tokens: Any
    mask: Any  # [B, T] completion tokens
    old_logps: Any
    old_values: Any
    advantages: Any
    returns: Any


def train_ppo(cfg: RunConfig, *, resume: str | None = None) -> TrainResult:
    with run_lifecycle(cfg, resume=resume) as ctx:
        return asyncio.run(_train(ctx, cfg.algorithm.settings))  # type: ignore[arg-type]


def _policy_and_value(policy: Any, value: Any) -> Any:
    import torch

    class PolicyAndValue(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy, self.value = policy, value

    return PolicyAndValue()


def token_values(value_model: Any, tokens: Any) -> Any:
    """[B, T]: position t holds V(prefix < t), the value before generating token t."""
    import torch

    base = hf_model(value_model)
    hidden = base.base_model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
    v = base.score(hidden).squeeze(-1).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def completion_major(x: Any, mask: Any) -> tuple[Any, Any, Any]:
    """Move each row's completion tokens to the front: ([B, Tc] values, [B, Tc] mask, index)."""
    import torch

    lengths = mask.sum(1)
    starts = mask.float().argmax(1)
    width = int(lengths.max())
    offs = torch.arange(width, device=x.device)
    cmask = offs[None, :] < lengths[:, None]
    index = (starts[:, None] + offs[None, :]).clamp(max=x.shape[1] - 1)
    return x.gather(1, index) * cmask, cmask, index


def scatter_back(xc: Any, cmask: Any, index: Any, like: Any) -> Any:
    import torch

    out = torch.zeros_like(like, dtype=xc.dtype)
    rows = torch.arange(xc.shape[0], device=xc.device)[:, None].expand_as(index)
    out[rows[cmask], index[cmask]] = xc[cmask]
    return out


def make_ppo_loss_fn(s: PPOConfig, normalizer: float) -> Any:
    from rollout.losses.ppo import ppo_loss

    def loss_fn(model: Any, b: PPOBatch) -> tuple[Any, dict[str, float]]:
        logps, entropy = token_logps(model.policy, b.tokens, with_entropy=True)
        values = token_values(model.value, b.tokens)
        loss, metrics = ppo_loss(
            logps, b.old_logps, b.advantages, values, b.old_values, b.returns, b.mask,
            clip_ratio=s.clip_ratio, clip_value=s.clip_value, vf_coef=s.vf_coef, normalizer=normalizer,
        )
        metrics["entropy_sum"] = float(entropy[b.mask].sum())
        return loss, metrics

    return loss_fn


async def _train(ctx: RunContext, s: PPOConfig) -> TrainResult:
    import torch

    from rollout.backends.torch_backend import move_to, pick_device
    from rollout.data.collate import collate_padded
    from rollout.data.jsonl import read_rows
    from rollout.inference.types import SamplingParams
    from rollout.losses.ppo import compute_gae, kl_penalized_rewards, whiten
    from rollout.rl.buffer import DataBuffer
    from rollout.rl.manager import RolloutManager

    cfg, rec = ctx.config, ctx.recorder
    prepare_process(cfg)
    if s.budget.max_steps is None:
        raise AlgorithmError("ppo needs budget.max_steps (epochs and tokens are not defined for sampled data)")
    total_steps = s.budget.max_steps

    tokenizer = load_tokenizer(s.base_model)
    pad_id = tokenizer.pad_token_id
    rows, report = read_rows(s.dataset.path, "prompt", on_bad_line=s.dataset.on_bad_line)
    data = [r.data for r in rows]
    reward_fns = resolve_reward_specs(s)
    device = pick_device(cfg.backend.device)
    engine = build_engine(s, cfg.inference, device)
    manager = RolloutManager(
        engine, data, DataBuffer(len(data), seed=cfg.seed), reward_fns=reward_fns,
        num_generations=s.num_generations, prompts_per_batch=s.minibatch_size,
        sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens),
        seed=cfg.seed, max_staleness=s.max_staleness, reward_timeout_s=s.reward_timeout_s,
        on_event=lambda name, fields: rec.event(name, **fields),
    )

    policy = load_trainable(s, task="causal_lm", pad_token_id=pad_id, seed=cfg.seed, device=device)
    value = load_model(s.base_model, task="reward", pad_token_id=pad_id, seed=cfg.seed + 1)
    model = _policy_and_value(policy, value).to(device)
    ref_model, ref_adapter = None, False
    if s.kl_coef > 0:
        ref_uri = s.reference.uri or s.base_model.uri
        if s.lora is not None and ref_uri == s.base_model.uri:
            ref_model, ref_adapter = policy, True
        else:
            ref_model = load_model(s.base_model.model_copy(update={"uri": ref_uri}), task="causal_lm",
                                   pad_token_id=pad_id, seed=cfg.seed).to(device).eval()
            ref_model.requires_grad_(False)
    backend = build_torch_backend(model, s, total_steps=total_steps, device=device)
    static_blobs = model_file_blobs(policy, tokenizer)
    loop = await restore_or_start(ctx, backend)
    source = BatchSource(manager, engine, ctx, pipelined=s.off_policy_steps == 1)
    version = 0
    if ctx.resume_from is not None:
        manager.load_state_dict(loop.restored["manager"])
        source.restore(loop.restored.get("pending"))
        version = loop.restored["version"]

    extra = snapshot_extra(cfg, s, model_class="causal_lm", policy_prefix=POLICY)
    rec.event("train_start", algorithm="ppo", total_steps=total_steps, start_step=loop.step, device=str(device),
              num_prompts=len(data), num_skipped_lines=report.num_skipped, rewards=[n for n, _, _ in reward_fns],
              resumed_from=ctx.resume_from.id if ctx.resume_from else None)

    def policy_weights(all_weights: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix(POLICY): v for k, v in all_weights.items() if k.startswith(POLICY)}

    last: dict[str, float] = {}
    empty_streak = 0
    try:
        with TrainProgress("ppo", total_steps, start=loop.step) as progress:
            while loop.step < total_steps:
                batch = await source.next(policy_weights(await backend.export_weights()), version)
                empty_streak = require_samples(batch, loop.step + 1, empty_streak)
                if empty_streak:
                    continue
                t_train = time.perf_counter()
                samples = list(batch.ok_samples())
                tokens = move_to(collate_padded(sample_sequences(samples), pad_id), device)
                mask = tokens.loss_mask.clone()
                mask[:, 0] = False
                with torch.no_grad():
                    model.eval()
                    old_logps = frozen_token_logps(policy, tokens)
                    old_values = token_values(value, tokens) * mask
                    ref_logps = (frozen_token_logps(ref_model, tokens, adapter_disabled=ref_adapter)
                                 if ref_model is not None else old_logps)
                    model.train()
                    scores = torch.tensor([x.reward for x in samples], dtype=torch.float32, device=device)
                    token_rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, kl_coef=s.kl_coef)
                    rc, cmask, index = completion_major(token_rewards, mask)
                    vc, _, _ = completion_major(old_values, mask)
                    adv_c, ret_c = compute_gae(rc, vc, cmask, gamma=s.gamma, lam=s.lam)
                    if s.whiten_advantages and int(cmask.sum()) >= 2:
                        adv_c = whiten(adv_c, cmask)
                    advantages = scatter_back(adv_c, cmask, index, old_logps)
                    returns = scatter_back(ret_c, cmask, index, old_logps)
                rows_ = list(range(len(samples)))
                chunks = [c for c in (rows_[i :: s.gradient_accumulation] for i in range(s.gradient_accumulation)) if c]
                micro = [
                    PPOBatch(_rows(tokens, c), mask[c], old_logps[c], old_values[c], advantages[c], returns[c])
                    for c in chunks
                ]
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
                    loop.step += 1
                    step_tokens = int(tokens.attention_mask.sum())
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
                    progress.update(loop.step, {"loss": last["train/loss"], "reward": last.get("rollout/reward_mean", 0.0)})
                version += 1
                every = s.snapshot.every_steps
                if every and loop.step < total_steps and loop.step // every > (loop.step - s.num_iterations) // every:
                    await snapshot_rl(ctx, backend, source, manager, loop, version, static_blobs, extra)
        await snapshot_rl(ctx, backend, source, manager, loop, version, static_blobs, extra)
    finally:
        await source.close()
        engine.close()
    return await finish_training(ctx, backend, policy, tokenizer, s, loop, static_blobs=static_blobs,
                                 extra=extra, metrics=last)


def _rows(tokens: Any, rows: list[int]) -> Any:
    """A TokenBatch of some rows of `tokens` (same width)."""
    sub = {f.name: getattr(tokens, f.name) for f in dataclasses.fields(tokens)}
    for name, value in sub.items():
        if hasattr(value, "shape") and value.dim() >= 1 and value.shape[0] == tokens.input_ids.shape[0]:
            sub[name] = value[rows]
    sub["num_tokens"] = int(sub["attention_mask"].sum())
    sub["num_loss_tokens"] = int(sub["loss_mask"][:, 1:].sum())
    return dataclasses.replace(tokens, **sub)

