"""Pieces GRPO and PPO share: the sampling engine with its sampler and weight sync, rewards,
the (optionally pipelined) batch source, and the RL snapshot. Each recipe still
builds its own manager, model and loop.

Pipelining (`off_policy_steps = 1`): the batch for step t+1 is generated
while step t trains. The engine holds its own copy of the weights, updated
through the `WeightSync` after each step, so generation and training never
share tensors; a batch trained at step t was sampled with the weights of step
t-1 (staleness 1), and the importance-sampling correction uses the engine's
own log-probs. A batch generated but not yet trained is part of the snapshot,
which is what makes resume bit-identical with pipelining on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollout.algorithms.config import EpisodeEnvConfig, RewardModelSpec, SidecarRewardSpec
from rollout.algorithms.config import RewardSpec as RewardFunctionSpec
from rollout.backends.base import TrainingBackend
from rollout.checkpoint import LoopState
from rollout.errors import AlgorithmError, ConfigError
from rollout.inference.build import build_engine as build_configured_engine
from rollout.inference.config import InferenceConfig
from rollout.inference.hf_engine import BATCH_INVARIANT_PAD, load_hf_engine
from rollout.inference.kept_cache import DEFAULT_KEPT_CACHE_BYTES
from rollout.inference.models import ResolvedModel
from rollout.inference.sampler import EngineSampler
from rollout.inference.types import InferenceEngine
from rollout.inference.weight_sync import DiskReloadWeightSync, InProcessWeightSync, WeightSync
from rollout.models.load import ModelSource
from rollout.rl.envs import resolve_env, reward_from_env
from rollout.rl.episode import EpisodeLimits, EpisodeSetup
from rollout.rl.manager import RolloutManager
from rollout.rl.reward_model import NormalizedReward, export_reward_model_snapshot, load_reward_model
from rollout.rl.rewards import resolve_reward
from rollout.rl.tools import resolve_tools
from rollout.rl.types import RewardSpec, RolloutBatch, Sample
from rollout.run import RunContext, snapshot_backend
from rollout.sidecar import close_sidecars

Weights = Mapping[str, torch.Tensor]


def resolve_reward_specs(
    rewards: Sequence[RewardFunctionSpec | RewardModelSpec | SidecarRewardSpec],
    env: str | EpisodeEnvConfig | None, *,
    ctx: RunContext | None = None, device: torch.device | None = None, dtype: str = "float32",
) -> list[RewardSpec]:
    """(name, callable, weight) for every [[rewards]] entry (a reward model is loaded here, on
    `device`; a snapshot id is exported from `ctx`'s store first; a normalised one is two specs:
    its raw score, weight 0, and the normalised score), plus an `env = "name"` as a reward (an
    [env] table scores its own episodes: see `episode_setup`)."""
    specs: list[RewardSpec] = []
    for entry in rewards:
        if isinstance(entry, RewardModelSpec):
            rm = build_reward_model(entry, ctx=ctx, device=device, dtype=dtype)
            if entry.normalize == "none":
                specs.append((entry.name, rm, entry.weight))
            else:  # the raw score is logged as <name>; the normalised one carries the weight
                specs += [(entry.name, rm.raw, 0.0), (f"{entry.name}_{entry.normalize}", rm, entry.weight)]
        elif isinstance(entry, SidecarRewardSpec):  # its process starts on the first batch
            specs.append((entry.label, resolve_reward(entry), entry.weight))
        else:
            specs.append((entry.name, resolve_reward(entry.name), entry.weight))
    if isinstance(env, str):
        specs.append((f"env:{env}", reward_from_env(resolve_env(env), name=env), 1.0))
    return specs


def build_reward_model(
    entry: RewardModelSpec, *, ctx: RunContext | None, device: torch.device | None, dtype: str
) -> NormalizedReward:
    """A `kind = "reward_model"` entry as a frozen RM reward function (a served one is checked here,
    before the run trains: reachable, with its key, and a reward model)."""
    if entry.url is not None:
        return served_reward_model(entry)
    path = entry.model
    if entry.snapshot is not None:
        if ctx is None:
            raise AlgorithmError(f"reward model {entry.name}: a snapshot id needs the run's store")
        path = export_reward_model_snapshot(ctx.store, ctx.objects, entry.snapshot, ctx.run_dir / "reward-models")
    assert path is not None  # the config holds exactly one of model, snapshot and url
    seed = ctx.config.seed if ctx is not None else 0
    return load_reward_model(
        path, device=device or torch.device("cpu"), dtype=dtype, batch_size=entry.batch_size,
        max_seq_len=entry.max_seq_len, normalize=entry.normalize, seed=seed,
    )


def served_reward_model(entry: RewardModelSpec) -> NormalizedReward:
    """A `url` entry as a `ServedRewardModel`, checked against its server."""
    import os

    from rollout.rl.served_reward import RewardServerError, ServedRewardModel

    assert entry.url is not None
    key = None
    if entry.api_key_env is not None:
        key = os.environ.get(entry.api_key_env)
        if not key:
            raise ConfigError(f"reward model {entry.name}: api_key_env names ${entry.api_key_env}, which is not set")
    rm = ServedRewardModel(entry.url, api_key=key, batch_size=entry.batch_size, timeout_s=entry.request_timeout_s,
                           max_retries=entry.max_retries, normalize=entry.normalize)
    try:
        rm.check()
    except RewardServerError as err:
        raise ConfigError(f"reward model {entry.name}: {err}") from None
    return rm


def reward_states(specs: Sequence[RewardSpec]) -> dict[str, dict[str, Any]]:
    """The state of every stateful reward (an RM's running moments), by name, for a snapshot."""
    return {name: fn.state_dict() for name, fn, _ in specs if isinstance(fn, NormalizedReward) and fn.normalize == "running"}


def load_reward_states(specs: Sequence[RewardSpec], states: Mapping[str, Any]) -> None:
    for name, fn, _ in specs:
        if isinstance(fn, NormalizedReward) and name in states:
            fn.load_state_dict(states[name])


def episode_setup(env: str | EpisodeEnvConfig | None, tokenizer: Any) -> EpisodeSetup | None:
    """Multi-turn episodes for an [env] table (None for single-turn scoring)."""
    if not isinstance(env, EpisodeEnvConfig):
        return None
    factory = resolve_env(env.name)
    options = dict(env.options)
    if env.tools:
        if not _takes_keyword(factory, "tools"):
            raise ConfigError(f"env {env.name!r} takes no `tools` argument, so it can't use the [env] tools")
        options["tools"] = resolve_tools(env.tools)
    limits = EpisodeLimits(
        max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
        step_timeout_s=env.step_timeout_s, max_concurrent_steps=env.max_concurrent_steps,
    )
    return EpisodeSetup(tokenizer, functools.partial(factory, **options) if options else factory, limits)


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True  # can't tell: let the call say
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def max_completion_tokens(max_tokens: int, env: str | EpisodeEnvConfig | None) -> int:
    """The longest completion a sample can have: one reply, or a whole episode after its prompt."""
    return env.max_episode_tokens if isinstance(env, EpisodeEnvConfig) else max_tokens


@dataclass(frozen=True)
class SamplingEngine:
    """The rollout side's engine, the sampler in front of it and how new weights reach it."""

    engine: InferenceEngine
    sampler: EngineSampler
    weight_sync: WeightSync
    group_runner: None = None  # groups are made here, by `sampler`

    def close(self) -> None:
        self.sampler.close()
        self.engine.close()


def hf_engine_limits(inference: InferenceConfig | None) -> tuple[int, int]:
    """(max batch size, kept-cache bytes) of an hf engine under `[inference]` (or its defaults):
    the in-process engine's and every Ray rollout worker's."""
    if inference is None:
        return 256, DEFAULT_KEPT_CACHE_BYTES
    return inference.max_batch_size, inference.kept_cache_mb << 20


def build_engine(
    base_model: ModelSource, *, inference: InferenceConfig | None, device: torch.device, weights_dir: Path,
    batch_invariant: bool = False,
) -> SamplingEngine:
    """The in-process hf engine by default (tensors handed over; with `batch_invariant`, log-probs
    that do not depend on the round a group is in, as Ray workers make them), or the configured
    [inference] engine (reloads `weights_dir/v<version>`)."""
    max_batch, kept_cache_bytes = hf_engine_limits(inference)
    if inference is not None and inference.engine != "hf":
        if inference.engine == "openai" and not (inference.base_url or inference.base_urls):
            raise ConfigError('[inference] engine = "openai" needs base_url (one server) or base_urls (a pool)')
        uri = base_model.uri
        engine = build_configured_engine(inference, ResolvedModel(uri, inference.model or uri, fixed_identity=None))
        return SamplingEngine(engine, EngineSampler(engine, max_batch=max_batch),
                              DiskReloadWeightSync(engine, weights_dir))
    engine = load_hf_engine(
        base_model.uri, dtype=base_model.dtype, device=str(device), max_batch_size=max_batch,
        trust_remote_code=base_model.trust_remote_code,
        pad_multiple=BATCH_INVARIANT_PAD if batch_invariant else 1,
        kept_cache_bytes=kept_cache_bytes,
    )
    return SamplingEngine(engine, EngineSampler(engine, max_batch=max_batch), InProcessWeightSync(engine))


def _on_policy_in_process(rollout_engine: Any, *, pipelined: bool) -> bool:
    """The engine samples in this process (weights handed over in memory) and generation never
    overlaps an optimizer step: what sharing parameters and generating inline both require."""
    return not pipelined and isinstance(getattr(rollout_engine, "weight_sync", None), InProcessWeightSync)


def share_policy_weights(
    rollout_engine: Any, policy: torch.nn.Module, *, pipelined: bool, lora: bool, distributed: bool
) -> bool:
    """Let the in-process hf engine sample with the policy's own parameters (no second copy, no
    copying push) where that is safe: on-policy (generation never overlaps an optimizer step), one
    process, no LoRA (the engine gets merged weights, which are a copy). The samples are the same
    as with a copy: the engine computes with the same values. True when the engine now shares."""
    engine = getattr(rollout_engine, "engine", None)
    share = getattr(engine, "share_parameters", None)
    if lora or distributed or share is None or not _on_policy_in_process(rollout_engine, pipelined=pipelined):
        return False
    return bool(share(policy))


def generate_on_training_thread(rollout_engine: Any, *, pipelined: bool) -> bool:
    """On-policy rounds of the in-process engine: generate on the event loop's thread, the one that
    trains (`EngineSampler.rounds_on_caller_thread`: one OpenMP team, not two). Multi-turn episodes
    too: their turns are synchronous (`rl/episode.py`: a turn's `submit_all` starts only after every
    env step of the turn before has ended), so no tool call's timeout is running on the loop while
    it generates. Measured on tools-grpo-tiny at 2 threads on 2 cores: 0.84-0.91 s/step against
    1.28-1.42 on a worker thread (1.17-1.20 at 1 thread either way). Not when pipelined (generation
    overlaps training), not for remote engines. True when set."""
    sampler = getattr(rollout_engine, "sampler", None)
    if not hasattr(sampler, "rounds_on_caller_thread"):
        return False
    if not _on_policy_in_process(rollout_engine, pipelined=pipelined):
        return False
    sampler.rounds_on_caller_thread = True
    return True


def plan_weight_copies(rollout_engine: Any, *, max_completion: int) -> bool:
    """The in-process hf engine keeps prepacked weight copies (`HFEngine.use_prepacked_weights`)
    only where a completion may run to `lean_decoder.PREPACK_MIN_TOKENS` tokens or more: the next
    optimizer step replaces the weights after every round, so the copies are made again for each
    round, and short rounds do not pay for them. Decided once per run from its settings, so every
    round computes the same way (a copy and `F.linear` can differ in the last bit) and a resumed
    run as the uninterrupted one. True when the engine multiplies by copies."""
    from rollout.models.lean_decoder import PREPACK_MIN_TOKENS

    use = getattr(getattr(rollout_engine, "engine", None), "use_prepacked_weights", None)
    return bool(use(max_completion >= PREPACK_MIN_TOKENS)) if use is not None else False


def rank_group_runner(
    rollout_engine: Any, dist: Any, group: Any, *, reward_fns: Sequence[Any], episodes: EpisodeSetup | None
) -> Any:
    """The manager's group runner on this learner: the rollout engine's own in one process; on
    torchrun's ranks each makes its share of a round on its engine and they exchange them
    (`RankGroups`); in a Ray learner group learner 0's rollout workers make it and the others
    receive it (`Rank0Groups`: learner 0 has the workers' runner, the others have None)."""
    from rollout.rl.ray_learners import Rank0Groups
    from rollout.rl.torchrun_rollout import RankGroups

    if not dist.active:
        return rollout_engine.group_runner
    if rollout_engine.sampler is None:  # no engine here: Ray's rollout workers (`RayRollout`, `FollowerRollout`)
        return Rank0Groups(rollout_engine.group_runner, dist)
    return RankGroups(rollout_engine.sampler, group, reward_fns=reward_fns, episodes=episodes, dist=dist)


def set_up_rollout_engine(
    rollout_engine: Any, policy: torch.nn.Module, *, pipelined: bool, lora: bool, distributed: bool,
    max_completion: int,
) -> tuple[bool, bool]:
    """What an RL trainer sets up on its rollout engine before the first round: sharing the
    policy's parameters, generating on the training thread, keeping weight copies (the three
    functions above). (engine shares weights, engine multiplies by weight copies)."""
    shared = share_policy_weights(rollout_engine, policy, pipelined=pipelined, lora=lora, distributed=distributed)
    generate_on_training_thread(rollout_engine, pipelined=pipelined)
    return shared, plan_weight_copies(rollout_engine, max_completion=max_completion)


def batch_to_dict(batch: RolloutBatch) -> dict[str, Any]:
    return {
        "samples": [s.to_dict() for s in batch.samples], "num_prompts": batch.num_prompts,
        "policy_version": batch.policy_version, "metrics": dict(batch.metrics),
    }


def batch_from_dict(data: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(
        samples=tuple(Sample.from_dict(s) for s in data["samples"]), num_prompts=data["num_prompts"],
        policy_version=data["policy_version"], metrics=data["metrics"],
    )


@dataclass
class BatchSource:
    """Hands out rollout batches, on-policy or one step ahead (pipelined), and carries the
    rollout side's state (the manager's, and a batch generated ahead) across snapshots."""

    manager: RolloutManager
    weight_sync: WeightSync
    pipelined: bool
    pending: asyncio.Future[RolloutBatch] | RolloutBatch | None = None
    gen_wait_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    async def next(self, weights: Weights, version: int) -> RolloutBatch:
        """The batch to train on now; the engine gets `weights` (policy version `version`) first."""
        t0 = time.perf_counter()
        if not self.pipelined:
            self.weight_sync.push(weights, version=version)
            batch = await self.manager.next_batch(version)
        else:
            fresh = self.pending is None  # first step of a fresh run: the engine has these weights next
            if fresh:
                self.weight_sync.push(weights, version=version)
                self.pending = asyncio.ensure_future(self.manager.next_batch(version))
            batch = await self._take()
            if not fresh:
                self.weight_sync.push(weights, version=version)
            self.pending = asyncio.ensure_future(self.manager.next_batch(version))
            await asyncio.sleep(0)  # let generation start before training blocks the loop
        self.gen_wait_s = time.perf_counter() - t0
        return batch

    async def _take(self) -> RolloutBatch:
        pending, self.pending = self.pending, None
        assert pending is not None
        return await pending if isinstance(pending, asyncio.Future) else pending

    async def settle(self) -> dict[str, Any] | None:
        """Finish any in-flight generation (before a snapshot); its batch, serialised."""
        if self.pending is None:
            return None
        if isinstance(self.pending, asyncio.Future):
            self.pending = await self.pending
        return batch_to_dict(self.pending)

    def restore(self, loop: LoopState) -> int:
        """Continue from a resumed run's loop state: the manager's state and any batch generated
        ahead; returns the policy version to continue from."""
        self.manager.load_state_dict(loop.restored["manager"])
        load_reward_states(self.manager.reward_fns, loop.restored.get("rewards", {}))
        pending = loop.restored.get("pending")
        self.pending = batch_from_dict(pending) if pending is not None else None
        version: int = loop.restored["version"]
        return version

    async def finish(self, export: Callable[[], Awaitable[Weights]], version: int) -> None:
        """After the last step: an engine that keeps serving gets the final policy."""
        await self.close()
        if self.weight_sync.keeps_serving:
            self.weight_sync.push(await export(), version=version)

    async def close(self) -> None:
        if isinstance(self.pending, asyncio.Future):
            with contextlib.suppress(Exception):  # the run is ending; its own error is what matters
                await self.pending
        await close_sidecars()  # reward / env / tool sidecars: no process outlives the run


def require_samples(batch: RolloutBatch, step: int, empty_streak: int) -> int:
    """Count consecutive empty batches; fail clearly instead of spinning forever."""
    if batch.ok_samples():
        return 0
    if empty_streak + 1 >= 5:
        raise AlgorithmError(
            f"step {step}: 5 rollout batches in a row had no usable samples "
            "(every reward failed or every group was filtered); check the reward functions and the data"
        )
    return empty_streak + 1


async def snapshot_rl(
    ctx: RunContext, backend: TrainingBackend[Any], source: BatchSource, loop: LoopState, version: int,
    static_blobs: Mapping[str, bytes], extra: Mapping[str, Any],
) -> str:
    """A train_state snapshot that also holds the manager's state and any batch generated ahead."""
    pending = await source.settle()
    state = {**loop.to_dict(), "manager": source.manager.state_dict(), "pending": pending, "version": version}
    rewards = reward_states(source.manager.reward_fns)
    if rewards:  # only runs with a stateful reward (a running-normalised RM) carry the key
        state["rewards"] = rewards
    return await snapshot_backend(ctx, backend, step=loop.step, loop_state=state, static_blobs=static_blobs, extra=extra)
