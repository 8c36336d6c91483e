"""`RolloutManager`: draw prompts, generate groups, score them, filter, and hand the learner a batch.

    manager = RolloutManager(EngineSampler(engine, max_batch=32), rows, DataBuffer(len(rows), seed=0),
                             reward_fns=[("correct", arithmetic_correct, 1.0)],
                             group=GroupSpec(8, SamplingParams(temperature=1.0, max_tokens=32), seed=0),
                             prompts_per_batch=16, dynamic_filtering=True)
    batch = await manager.next_batch(policy_version=step)      # a RolloutBatch of 16 groups
    state = manager.state_dict()                                # JSON: cursor, group counter, carried groups

One call runs rounds. A round draws `k` rows from the buffer; each row becomes
a group with a fresh `group_id` and one request for `num_generations` choices
seeded by `derive_seed(seed, group_id)`. All requests of a round go to the
sampler together (`submit_all`: with an `EngineSampler`, one `generate` call
on a worker thread; the engine batches), then every reward function scores
the round's completions at once (`score_batch`). With a `group_runner`
(`[distributed] kind = "ray"`: `rollout.rl.ray_rollout`) the round's groups
are made by rollout workers instead, each with `generate_groups` on its own
engine; everything else (drawing, filtering, carrying, the state) stays here.

Failures are data: a sample whose reward failed or abstained everywhere is
kept in its group with status "dropped". A group is usable when it has at
least one ok sample; under `dynamic_filtering` (DAPO, Yu et al. 2025,
arXiv:2503.14476) it also needs >= 2 ok samples whose rewards are not all
equal (zero-variance groups carry no GRPO advantage). Rounds continue while
the batch is short, at most `1 + max_oversample_rounds` rounds per call;
over-sampling rounds draw `missing / keep_rate` rows (keep rate of this call
so far, at most 4x), so they may overshoot: the extra usable groups are
carried to the next call (in the state), and dropped there if their policy
version is more than `max_staleness` behind. A batch can come back short or
empty when the rounds run out (event "batch_short").

Determinism: the samples depend only on the engine's weights, `seed`, the
sampling params and the state (buffer cursor, group counter, carried groups).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rollout.errors import ConfigError
from rollout.inference.sampler import RequestSampler
from rollout.inference.types import (
    Completion,
    GenerationRequest,
    Prompt,
    SamplingParams,
    derive_seed,
)
from rollout.rl.buffer import DataBuffer
from rollout.rl.episode import EpisodeSetup, episode_sample, run_episodes, sample_episode_metrics
from rollout.rl.rewards import score_batch
from rollout.rl.types import EventHook, RewardSpec, RolloutBatch, Sample

STATE_VERSION = 1
MAX_OVERSAMPLE_FACTOR = 4
Group = tuple[Sample, ...]


@dataclass
class _CallStats:
    """What one `next_batch` call did (turned into metrics at the end)."""

    rounds: int = 0
    groups_generated: int = 0
    groups_kept: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    samples_dropped: int = 0
    stale_groups: int = 0
    generation_s: float = 0.0
    tokens: int = 0
    carried_in: int = 0
    generated_rewards: list[float] = field(default_factory=list)  # every group this call made, filtered or not


@dataclass(frozen=True)
class GroupSpec:
    """How a group is sampled: what a rollout worker needs besides the rows, its engine and its rewards."""

    num_generations: int
    sampling: SamplingParams
    seed: int
    reward_timeout_s: float = 30.0


class RolloutManager:
    """Produces `RolloutBatch`es of scored groups from a sampler, a dataset and reward functions."""

    def __init__(
        self,
        sampler: RequestSampler | None,
        rows: Sequence[Mapping[str, Any]],
        buffer: DataBuffer,
        *,
        reward_fns: Sequence[RewardSpec],
        group: GroupSpec,
        prompts_per_batch: int,
        dynamic_filtering: bool = False,
        max_oversample_rounds: int = 4,
        max_staleness: int = 0,
        on_event: EventHook | None = None,
        episodes: EpisodeSetup | None = None,
        group_runner: GroupRunner | None = None,
    ) -> None:
        problems = []
        if sampler is None and group_runner is None:
            problems.append("a sampler or a group runner is needed")
        if buffer.num_rows != len(rows):
            problems.append(f"the data buffer has {buffer.num_rows} rows but the dataset has {len(rows)}")
        if not reward_fns and episodes is None:
            problems.append("at least one reward function (or multi-turn episodes scored by their env) is needed")
        names = [name for name, _, _ in reward_fns]
        if len(set(names)) != len(names):
            problems.append(f"reward function names must be unique, got {names}")
        if any(not math.isfinite(w) for _, _, w in reward_fns):
            problems.append("reward weights must be finite numbers")
        if group.num_generations < 1:
            problems.append(f"num_generations must be >= 1, got {group.num_generations}")
        if dynamic_filtering and group.num_generations < 2:
            problems.append(
                "dynamic_filtering needs num_generations >= 2 (it keeps groups with reward variance)"
            )
        if prompts_per_batch < 1:
            problems.append(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if max_oversample_rounds < 0:
            problems.append(f"max_oversample_rounds must be >= 0, got {max_oversample_rounds}")
        if max_staleness < 0:
            problems.append(f"max_staleness must be >= 0, got {max_staleness}")
        if not group.reward_timeout_s > 0:
            problems.append(f"reward_timeout_s must be > 0, got {group.reward_timeout_s}")
        if problems:
            raise ConfigError(f"invalid rollout settings: {problems[0]}", details=problems[1:])
        self.sampler = sampler
        self.rows = rows
        self.buffer = buffer
        self.reward_fns = tuple(reward_fns)
        self.group = group
        self.prompts_per_batch = prompts_per_batch
        self.dynamic_filtering = dynamic_filtering
        self.max_oversample_rounds = max_oversample_rounds
        self.max_staleness = max_staleness
        self.on_event = on_event
        self.episodes = episodes
        self.group_runner = group_runner
        self._next_group_id = 0
        self._carried: list[Group] = []
        self._totals: Counter[str] = Counter()

    # ------------------------------------------------------------------------ batches

    async def next_batch(self, policy_version: int) -> RolloutBatch:
        """The next `prompts_per_batch` usable groups (fewer only when the rounds run out)."""
        stats = _CallStats()
        ready = self._take_fresh_carried(policy_version, stats)
        while len(ready) < self.prompts_per_batch and stats.rounds <= self.max_oversample_rounds:
            missing = self.prompts_per_batch - len(ready)
            groups = await self._run_round(self._round_size(missing, stats), policy_version, stats)
            for group in groups:
                stats.generated_rewards.extend(s.reward for s in group if s.ok and s.reward is not None)
                reason = self._reject_reason(group)
                if reason is None:
                    ready.append(group)
                    stats.groups_kept += 1
                else:
                    stats.rejected[reason] += 1
        batch_groups, self._carried = ready[: self.prompts_per_batch], ready[self.prompts_per_batch :]
        self._report(stats, len(batch_groups))
        samples = tuple(s for g in batch_groups for s in g)
        return RolloutBatch(
            samples=samples,
            num_prompts=len(batch_groups),
            policy_version=min((s.policy_version for s in samples), default=policy_version),
            metrics=self._metrics(samples, stats),
        )

    def _take_fresh_carried(self, policy_version: int, stats: _CallStats) -> list[Group]:
        fresh = [g for g in self._carried if policy_version - g[0].policy_version <= self.max_staleness]
        stats.stale_groups = len(self._carried) - len(fresh)
        stats.carried_in = len(fresh)
        self._carried = []
        if stats.stale_groups:
            self._emit("stale_dropped", {"groups": stats.stale_groups, "policy_version": policy_version})
        return fresh

    def _round_size(self, missing: int, stats: _CallStats) -> int:
        """Rows to draw: what's missing, scaled up by this call's observed keep rate after round one."""
        if stats.groups_generated == 0:
            return missing
        keep_rate = max(stats.groups_kept / stats.groups_generated, 1 / MAX_OVERSAMPLE_FACTOR)
        return math.ceil(missing / keep_rate)

    def _reject_reason(self, group: Group) -> str | None:
        """Why a group can't train (None: it can). With dynamic filtering: fewer than 2 scored
        samples, one reward for all ("zero_std"), or one completion for all ("identical": a
        reward spread over the same tokens is the scorer's noise, not a signal to learn)."""
        ok = [s for s in group if s.reward is not None]
        if not ok:
            return "all_dropped"
        if self.dynamic_filtering:
            if len(ok) < 2:
                return "too_few_ok"
            rewards = [s.reward for s in ok]
            if max(rewards) == min(rewards):
                return "zero_std"
            if len({s.completion_token_ids for s in ok}) == 1:
                return "identical"
        return None

    async def _run_round(self, k: int, policy_version: int, stats: _CallStats) -> list[Group]:
        """Draw `k` rows and make one scored group each: here (one engine call for the round) or
        on the group runner's workers (`rollout.rl.ray_rollout`); the same samples either way."""
        indices = self.buffer.take(k)
        group_ids = list(range(self._next_group_id, self._next_group_id + k))
        self._next_group_id += k
        items = [(i, self.rows[i], gid) for i, gid in zip(indices, group_ids, strict=True)]
        if self.group_runner is not None:
            started = time.perf_counter()
            groups = await self.group_runner.run_groups(items, policy_version)
            generation_s = time.perf_counter() - started
        else:
            assert self.sampler is not None  # checked in __init__
            groups, generation_s = await generate_groups(
                self.sampler, items, self.group, reward_fns=self.reward_fns, episodes=self.episodes,
                policy_version=policy_version,
            )
        stats.generation_s += generation_s
        stats.rounds += 1
        stats.groups_generated += k
        samples = [s for g in groups for s in g]
        self._count_dropped(samples, policy_version, stats)
        if self.episodes is None:
            stats.tokens += sum(len(s.completion_token_ids) for s in samples)
            return groups
        stats.tokens += sum(sum(s.loss_mask) for s in samples)  # sampled tokens only, not the env's
        if errors := sum(bool(s.episode.get("env_error")) for s in samples):
            self._emit("env_errors", {"count": errors, "policy_version": policy_version})
        return groups

    def _count_dropped(self, samples: Sequence[Sample], policy_version: int, stats: _CallStats) -> None:
        """Count a round's dropped samples and report them (one `samples_dropped` event with the reasons)."""
        dropped = Counter(s.drop_reason for s in samples if not s.ok)
        if dropped:
            count = sum(dropped.values())
            stats.samples_dropped += count
            self._emit("samples_dropped", {"count": count, "reasons": dict(dropped), "policy_version": policy_version})

    # ------------------------------------------------------------------------ reporting

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(event, fields)

    def _report(self, stats: _CallStats, batch_groups: int) -> None:
        self._totals.update(
            batches=1,
            groups_generated=stats.groups_generated,
            groups_rejected=sum(stats.rejected.values()),
            samples_dropped=stats.samples_dropped,
            stale_groups=stats.stale_groups,
        )
        if stats.rejected:
            self._emit("groups_filtered", {"count": sum(stats.rejected.values()), **stats.rejected})
        if batch_groups < self.prompts_per_batch:
            self._emit(
                "batch_short",
                {"groups": batch_groups, "wanted": self.prompts_per_batch, "rounds": stats.rounds},
            )

    def _metrics(self, samples: tuple[Sample, ...], stats: _CallStats) -> dict[str, float]:
        ok = [s for s in samples if s.ok]
        rewards = [s.reward for s in ok if s.reward is not None]
        metrics: dict[str, float] = {
            "rollout/groups": float(len({s.group_id for s in samples})),
            "rollout/samples": float(len(samples)),
            "rollout/dropped": float(stats.samples_dropped),
            "rollout/stale_dropped": float(stats.stale_groups),
            "rollout/filtered_groups_frac": (
                sum(stats.rejected.values()) / stats.groups_generated if stats.groups_generated else 0.0
            ),
            "rollout/rounds": float(stats.rounds),
            "rollout/carried_in": float(stats.carried_in),
            "rollout/carried_out": float(len(self._carried)),
            "rollout/generation_s": stats.generation_s,
            "rollout/tokens": float(stats.tokens),
        }
        if samples:
            metrics["rollout/completion_len_mean"] = statistics.fmean(
                len(s.completion_token_ids) for s in samples
            )
            metrics["rollout/truncated_frac"] = sum(s.finish_reason == "length" for s in samples) / len(
                samples
            )
        if rewards:
            metrics["rollout/reward_mean"] = statistics.fmean(rewards)  # the batch trained on
            metrics["rollout/reward_std"] = statistics.pstdev(rewards)
        if stats.generated_rewards:  # the policy's own success rate: dynamic sampling's filter does not bias it
            metrics["rollout/reward_mean_generated"] = statistics.fmean(stats.generated_rewards)
        for name, _, _ in self.reward_fns:
            values = [v for s in ok if (v := s.reward_components.get(name)) is not None]
            if values:
                metrics[f"rollout/reward/{name}"] = statistics.fmean(values)
        if self.episodes is not None and samples:
            metrics.update(sample_episode_metrics(samples))
        if self.group_runner is not None:
            metrics.update(self.group_runner.take_metrics())
        return metrics

    # ------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the buffer cursor, the group counter, the carried groups and running totals."""
        return {
            "version": STATE_VERSION,
            "buffer": self.buffer.state_dict(),
            "next_group_id": self._next_group_id,
            "carried": [[s.to_dict() for s in group] for group in self._carried],
            "totals": dict(self._totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"rollout manager state has version {state.get('version')!r}; this code reads {STATE_VERSION}"
            )
        self.buffer.load_state_dict(dict(state["buffer"]))
        self._next_group_id = int(state["next_group_id"])
        self._carried = [tuple(Sample.from_dict(s) for s in group) for group in state["carried"]]
        self._totals = Counter({k: int(v) for k, v in state["totals"].items()})

    @property
    def totals(self) -> Mapping[str, int]:
        """Counts since the start of the run (saved in the state): batches, groups, drops."""
        return dict(self._totals)


RoundItem = tuple[int, Mapping[str, Any], int]
"""(row index, row, group id): one group to make."""


class GroupRunner(Protocol):
    """Makes a round's groups elsewhere (Ray rollout workers): the groups `generate_groups` would
    make, in the order of `items`."""

    async def run_groups(self, items: Sequence[RoundItem], policy_version: int) -> list[Group]: ...

    def take_metrics(self) -> dict[str, float]:
        """Its own metrics since the last call (per worker), added to the batch's."""
        ...


async def generate_groups(
    sampler: RequestSampler, items: Sequence[RoundItem], spec: GroupSpec, *,
    reward_fns: Sequence[RewardSpec], episodes: EpisodeSetup | None, policy_version: int,
) -> tuple[list[Group], float]:
    """One scored group of `spec.num_generations` samples per item, in item order, and the seconds
    spent generating. Single-turn: every request in one engine call (seeded by `derive_seed(seed,
    group_id)`), then every reward function on all completions at once; multi-turn: the episodes,
    every turn one engine batch. The samples depend only on the engine's weights, `spec` and the
    items, not on which other items share the call."""
    started = time.perf_counter()
    if episodes is not None:
        runs = await run_episodes(
            sampler, episodes.tokenizer, episodes.env_factory, [(gid, row) for _, row, gid in items],
            num_generations=spec.num_generations, sampling=spec.sampling, seed=spec.seed, limits=episodes.limits,
        )
        groups = [
            tuple(episode_sample(ep, row, i, policy_version) for ep in group)
            for (i, row, _), group in zip(items, runs, strict=True)
        ]
        return groups, time.perf_counter() - started
    requests = [
        GenerationRequest(
            prompt=_prompt_of(row),
            params=replace(spec.sampling, n=spec.num_generations, seed=derive_seed(spec.seed, gid)),
        )
        for _, row, gid in items
    ]
    outputs: list[tuple[Completion, ...]] = await asyncio.gather(*sampler.submit_all(requests))
    generation_s = time.perf_counter() - started
    flat = [(i, row, gid, c) for (i, row, gid), choices in zip(items, outputs, strict=True) for c in choices]
    field_names = sorted({key for _, row, _ in items for key in row if key != "prompt"})
    rewards, components, failures = await score_batch(
        reward_fns,
        [_prompt_of(row) for _, row, _, _ in flat],
        [c.text for _, _, _, c in flat],
        {name: [row.get(name) for _, row, _, _ in flat] for name in field_names},
        timeout_s=spec.reward_timeout_s,
    )
    samples = [
        _make_sample(row, i, gid, c, reward, parts, failure, policy_version)
        for (i, row, gid, c), reward, parts, failure in zip(flat, rewards, components, failures, strict=True)
    ]
    by_group: dict[int, list[Sample]] = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    return [tuple(by_group[gid]) for _, _, gid in items], generation_s


def _prompt_of(row: Mapping[str, Any]) -> Prompt:
    return row["prompt"]


def _make_sample(
    row: Mapping[str, Any],
    index: int,
    group_id: int,
    completion: Completion,
    reward: float | None,
    components: dict[str, float | None],
    failure: str | None,
    policy_version: int,
) -> Sample:
    drop_reason = (
        failure if failure is not None else None if reward is not None else "all reward functions abstained"
    )
    return Sample(
        prompt_index=index,
        group_id=group_id,
        prompt=row["prompt"],
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.token_ids,
        completion_text=completion.text,
        rollout_logprobs=completion.logprobs,
        finish_reason=completion.finish_reason,
        reward=reward,
        reward_components=components,
        status="ok" if reward is not None else "dropped",
        policy_version=policy_version,
        metadata={k: v for k, v in row.items() if k != "prompt"},
        drop_reason=drop_reason,
    )
