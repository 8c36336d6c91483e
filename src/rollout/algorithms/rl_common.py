"""Pieces GRPO and PPO share: the sampling engine, rewards, the rollout
manager, token-level log-probs, and the (optionally pipelined) batch source.

Pipelining (`off_policy_steps = 1`): the batch for step t+1 is generated
while step t trains. The engine holds its own copy of the weights, updated
through `update_weights` after each step, so generation and training never
share tensors; a batch trained at step t was sampled with the weights of step
t-1 (staleness 1), and the importance-sampling correction uses the engine's
own log-probs. A batch generated but not yet trained is part of the snapshot,
which is what makes resume bit-identical with pipelining on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.algorithms.common import RunContext
from rollout.errors import AlgorithmError


def resolve_reward_specs(s: Any) -> list[tuple[str, Any, float]]:
    """(name, callable, weight) for every [[rewards]] entry, plus the env as a reward."""
    from rollout.rl.envs import resolve_env, reward_from_env
    from rollout.rl.rewards import resolve_reward

    specs = [(r.name, resolve_reward(r.name), r.weight) for r in s.rewards]
    if s.env is not None:
        specs.append((f"env:{s.env}", reward_from_env(resolve_env(s.env), name=s.env), 1.0))
    return specs


def build_engine(s: Any, inference: Any, device: Any) -> Any:
    """The sampling engine: in-process hf engine by default, or the configured [inference] engine."""
    if inference is not None and inference.engine != "hf":
        from rollout.inference.build import build_engine as build_configured
        from rollout.inference.models import ResolvedModel

        uri = s.base_model.uri
        return build_configured(inference, ResolvedModel(uri, inference.model or uri, fixed_identity=None))
    from rollout.inference.hf_engine import load_hf_engine

    return load_hf_engine(
        s.base_model.uri, dtype=s.base_model.dtype, device=str(device),
        max_batch_size=inference.max_batch_size if inference is not None else 256,
        trust_remote_code=s.base_model.trust_remote_code,
    )


def push_weights(engine: Any, weights: dict[str, Any], *, ctx: RunContext, version: int) -> None:
    """In-process engines take the tensors; remote ones reload from an exported folder."""
    from rollout.inference.hf_engine import HFEngine

    if isinstance(engine, HFEngine):
        engine.update_weights(weights)
        return
    import safetensors.torch

    folder = ctx.run_dir / "weights" / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    engine.update_weights(str(folder))


def sample_sequences(samples: Sequence[Any]) -> list[Any]:
    """prompt + completion token ids, the loss on the completion."""
    from rollout.data.tokenize import TokenizedSample

    return [
        TokenizedSample(
            input_ids=tuple(s.prompt_token_ids) + tuple(s.completion_token_ids),
            loss_mask=(False,) * len(s.prompt_token_ids) + (True,) * len(s.completion_token_ids),
        )
        for s in samples
    ]


def place_completion_values(samples: Sequence[Any], values: Sequence[Sequence[float]], width: int) -> Any:
    """[B, width] tensor with each sample's per-completion-token values at its completion positions."""
    import torch

    out = torch.zeros(len(samples), width)
    for i, (s, vals) in enumerate(zip(samples, values, strict=True)):
        start = len(s.prompt_token_ids)
        out[i, start : start + len(vals)] = torch.tensor(list(vals), dtype=torch.float32)
    return out


def token_logps(model: Any, tokens: Any, *, with_entropy: bool = False) -> tuple[Any, Any]:
    """Per-token log-probs [B, T] (position t holds log p(token t | < t); 0 off the loss mask)
    and, optionally, per-token entropies [B, T]. The LM head runs only at loss positions."""
    import torch
    import torch.nn.functional as F

    from rollout.losses.logps import unwrap_peft

    base = unwrap_peft(model)
    hidden = base.get_decoder()(
        input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, use_cache=False
    ).last_hidden_state
    sel = tokens.loss_mask[:, 1:]
    logits = base.get_output_embeddings()(hidden[:, :-1][sel]).float()
    logp_all = F.log_softmax(logits, dim=-1)
    picked = logp_all.gather(1, tokens.input_ids[:, 1:][sel].unsqueeze(1)).squeeze(1)
    b, t = tokens.input_ids.shape
    pad = torch.zeros(b, 1, dtype=picked.dtype, device=picked.device)
    logps = torch.cat([pad, torch.zeros(b, t - 1, dtype=picked.dtype, device=picked.device).masked_scatter(sel, picked)], 1)
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1).detach()
        entropy = torch.cat([pad, torch.zeros(b, t - 1, device=ent.device).masked_scatter(sel, ent)], 1)
    return logps, entropy


def frozen_token_logps(model: Any, tokens: Any, *, adapter_disabled: bool = False) -> Any:
    from contextlib import nullcontext

    import torch

    guard = model.disable_adapter() if adapter_disabled else nullcontext()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), guard:
            return token_logps(model, tokens)[0]
    finally:
        model.train(was_training)


def batch_to_dict(batch: Any) -> dict[str, Any]:
    return {
        "samples": [s.to_dict() for s in batch.samples], "num_prompts": batch.num_prompts,
        "policy_version": batch.policy_version, "metrics": dict(batch.metrics),
    }


def batch_from_dict(data: dict[str, Any]) -> Any:
    from rollout.rl.types import RolloutBatch, Sample

    return RolloutBatch(
        samples=tuple(Sample.from_dict(s) for s in data["samples"]), num_prompts=data["num_prompts"],
        policy_version=data["policy_version"], metrics=data["metrics"],
    )


@dataclass
class BatchSource:
    """Hands out rollout batches, on-policy or one step ahead (pipelined)."""

    manager: Any
    engine: Any
    ctx: RunContext
    pipelined: bool
    pending: Any = None  # asyncio.Task or a finished RolloutBatch
    gen_wait_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    async def next(self, weights: dict[str, Any], version: int) -> Any:
        """The batch to train on now; the engine gets `weights` (policy version `version`) first."""
        t0 = time.perf_counter()
        if not self.pipelined:
            push_weights(self.engine, weights, ctx=self.ctx, version=version)
            batch = await self.manager.next_batch(version)
        else:
            if self.pending is None:  # first step of a fresh run
                push_weights(self.engine, weights, ctx=self.ctx, version=version)
                self.pending = asyncio.ensure_future(self.manager.next_batch(version))
            batch = await self._take()
            push_weights(self.engine, weights, ctx=self.ctx, version=version)
            self.pending = asyncio.ensure_future(self.manager.next_batch(version))
            await asyncio.sleep(0)  # let generation start before training blocks the loop
        self.gen_wait_s = time.perf_counter() - t0
        return batch

    async def _take(self) -> Any:
        pending, self.pending = self.pending, None
        return await pending if isinstance(pending, asyncio.Future) else pending

    async def settle(self) -> dict[str, Any] | None:
        """Finish any in-flight generation (before a snapshot); its batch, serialised."""
        if self.pending is None:
            return None
        if isinstance(self.pending, asyncio.Future):
            self.pending = await self.pending
        return batch_to_dict(self.pending)

    def restore(self, pending: dict[str, Any] | None) -> None:
        self.pending = batch_from_dict(pending) if pending is not None else None

    async def close(self) -> None:
        if isinstance(self.pending, asyncio.Future):
            with contextlib.suppress(Exception):  # the run is ending; its own error is what matters
                await self.pending


def require_samples(batch: Any, step: int, empty_streak: int) -> int:
    """Count consecutive empty batches; fail clearly instead of spinning forever."""
    if batch.ok_samples():
        return 0
    if empty_streak + 1 >= 5:
        raise AlgorithmError(
            f"step {step}: 5 rollout batches in a row had no usable samples "
            "(every reward failed or every group was filtered); check the reward functions and the data"
        )
    return empty_streak + 1


async def snapshot_rl(ctx, backend, source, manager, loop, version, static_blobs, extra) -> str:  # noqa: ANN001
    """A train_state snapshot that also holds the manager's state and any batch generated ahead."""
    from rollout.algorithms.common import snapshot_backend

    pending = await source.settle()
    state = {**loop.to_dict(), "manager": manager.state_dict(), "pending": pending, "version": version}
    return await snapshot_backend(ctx, backend, step=loop.step, loop_state=state, static_blobs=static_blobs, extra=extra)
