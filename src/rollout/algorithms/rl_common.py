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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.errors import AlgorithmError
from rollout.run import RunContext, snapshot_backend


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
    """In-process engines take the tensors; remote ones reload from a folder this run writes.

    The remote folder is `runs/<run>/weights/v<version>` (the server must see the same
    filesystem, as with SGLang's `update_weights_from_disk`); once the server has
    loaded it, the folder of the previous version is removed so pushes do not pile up.
    """
    if not is_remote(engine):
        engine.update_weights(weights)
        return
    import shutil

    import safetensors.torch

    root = ctx.run_dir / "weights"
    folder = root / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    # a copy of every tensor: tied weights (embeddings = lm_head) share storage, which safetensors refuses
    safetensors.torch.save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()},
                                folder / "model.safetensors")
    engine.update_weights(str(folder))
    for old in root.iterdir():
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def is_remote(engine: Any) -> bool:
    """Whether `engine` generates elsewhere (weights travel through a folder), not in this process."""
    from rollout.inference.hf_engine import HFEngine

    return not isinstance(engine, HFEngine)


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
            fresh = self.pending is None  # first step of a fresh run: the engine has these weights next
            if fresh:
                push_weights(self.engine, weights, ctx=self.ctx, version=version)
                self.pending = asyncio.ensure_future(self.manager.next_batch(version))
            batch = await self._take()
            if not fresh:
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

    async def finish(self, export: Callable[[], Awaitable[dict[str, Any]]], version: int) -> None:
        """After the last step: a remote server gets the final policy (users may keep serving it)."""
        await self.close()
        if is_remote(self.engine):
            push_weights(self.engine, await export(), ctx=self.ctx, version=version)

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
    pending = await source.settle()
    state = {**loop.to_dict(), "manager": manager.state_dict(), "pending": pending, "version": version}
    return await snapshot_backend(ctx, backend, step=loop.step, loop_state=state, static_blobs=static_blobs, extra=extra)
