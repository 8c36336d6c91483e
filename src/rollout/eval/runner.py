"""Run an eval: n samples per prompt row, each scored by a fresh env episode, with pass@k and friends.

    sampler = EngineSampler(engine, max_batch=128)
    result = asyncio.run(run_eval(sampler, resolve_env("arithmetic"), rows, n=8, seed=0,
                                  params=SamplingParams(temperature=1.0, max_tokens=32)))
    result.summary.metrics["pass@8"], result.samples[0].completion

Sample j of prompt row i is drawn with seed `derive_seed(seed, i, j)` (turn t > 0 of a
multi-turn episode with `derive_seed(sample_seed, t)`), so what a sample says does not depend
on batching, order, concurrency or which process ran it — and a resumed eval draws exactly
what an uninterrupted one would have.

One sample is one episode (`run_single_turn_episode`): `env.reset(row)`, then the model's
answer goes to `env.step`; an env that is not done yet gets its messages sent back to the
model through the chat API until it is done or `max_turns` turns were taken. That function
is the seam a token-level multi-turn episode runner (DESIGN.md `rl/episode.py`) replaces; it
is passed as `episode=`.

Failures are data: a sample the engine could not produce after its retries (`SampleFailed`)
becomes a row with `failed=True` and the error, and the metrics count it as a lost sample.
Env exceptions are not swallowed: they stop the eval (what was written stays; resume later).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollout.errors import RolloutError
from rollout.eval.metrics import EvalSummary, SampleOutcome, summarize
from rollout.inference.sampler import SampleFailed, Sampler
from rollout.inference.types import Message, SamplingParams, derive_seed
from rollout.rl.types import Env, EnvFactory
from rollout.store.base import EvalSampleRecord

WRITE_EVERY_SAMPLES = 64
WRITE_EVERY_S = 1.0


@dataclass(frozen=True)
class Episode:
    """What one episode produced; `error` is set (and the rest partial) when sampling failed for good."""

    messages: tuple[Message, ...]
    reward: float
    answer: str | None
    turns: int
    tool_calls: int
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    truncated: bool
    error: str | None = None


EpisodeRunner = Callable[[Sampler, Env, Mapping[str, Any], SamplingParams, int], Awaitable[Episode]]
"""(sampler, fresh env, data row, sampling params with the sample's seed, max_turns) -> Episode."""


@dataclass(frozen=True)
class EvalResult:
    """Every sample of the eval (those passed in as `previous` included), sorted, and their summary."""

    samples: list[EvalSampleRecord]
    summary: EvalSummary


async def run_single_turn_episode(
    sampler: Sampler, env: Env, row: Mapping[str, Any], params: SamplingParams, max_turns: int
) -> Episode:
    """One episode at the text level: reset, then sample → step until done or `max_turns` turns.

    Single-turn envs finish after the first step. For a multi-turn env, the env's messages
    are appended to the conversation and the whole conversation goes back through the chat
    template (text level: earlier turns are re-tokenised, fine for eval, not for RL).
    The reward is the sum of the steps' rewards; the answer is the last `info["extracted"]`.
    """
    assert params.seed is not None, "every eval sample has its own seed"
    messages: list[Message] = list(await env.reset(row))
    env_tools = getattr(env, "tools", None)
    tools = [t.openai_schema() for t in env_tools] if env_tools else None
    reward, answer, tool_calls = 0.0, None, 0
    prompt_tokens = completion_tokens = turns = 0
    truncated, finish_reason = False, None
    while True:
        turn_seed = params.seed if turns == 0 else derive_seed(params.seed, turns)
        try:
            completion = await sampler.sample(messages, replace(params, seed=turn_seed), tools=tools)
        except SampleFailed as err:
            return Episode(
                tuple(messages), reward, answer, turns, tool_calls, None, prompt_tokens,
                completion_tokens, truncated, error=str(err),
            )  # fmt: skip
        turns += 1
        prompt_tokens += completion.prompt_tokens
        completion_tokens += completion.completion_tokens
        finish_reason = completion.finish_reason
        truncated = truncated or completion.finish_reason == "length"
        assistant: Message = {"role": "assistant", "content": completion.text}
        messages.append(assistant)
        step = await env.step(assistant)
        reward += float(step.reward)
        if step.info.get("extracted") is not None:
            answer = str(step.info["extracted"])
        if step.done:
            break
        if turns >= max_turns:
            truncated, finish_reason = True, "max_turns"
            break
        messages.extend(dict(m) for m in step.messages)
        tool_calls += int(step.info.get("tool_calls", sum(1 for m in step.messages if m.get("role") == "tool")))
    return Episode(
        tuple(messages), reward, answer, turns, tool_calls, finish_reason, prompt_tokens,
        completion_tokens, truncated,
    )  # fmt: skip


async def run_eval(
    sampler: Sampler,
    env_factory: EnvFactory,
    rows: Sequence[Mapping[str, Any]],
    *,
    n: int,
    seed: int,
    params: SamplingParams,
    max_turns: int = 8,
    success_threshold: float = 1.0,
    ks: Sequence[int] | None = None,
    previous: Sequence[EvalSampleRecord] = (),
    on_samples: Callable[[list[EvalSampleRecord]], None] | None = None,
    max_active: int = 256,
    episode: EpisodeRunner = run_single_turn_episode,
) -> EvalResult:
    """Draw and score every (prompt, sample) pair not in `previous`; summarise them all.

    `on_samples` receives the new samples in batches (every ~64 samples or ~1 s, and at the
    end), on a worker thread so a store write never blocks the event loop; batches are
    delivered one at a time. `max_active` bounds the episodes in progress (and so memory).
    The summary's bootstrap CIs use `seed`, so the same samples always give the same numbers.
    """
    if n < 1 or max_turns < 1 or max_active < 1:
        raise ValueError(f"n, max_turns and max_active must be >= 1, got {n}, {max_turns}, {max_active}")
    done = {(s.prompt_index, s.sample_index) for s in previous}
    todo = iter([(i, j) for i in range(len(rows)) for j in range(n) if (i, j) not in done])
    writer = _BatchWriter(on_samples)
    new: list[EvalSampleRecord] = []

    async def work() -> None:
        for i, j in todo:  # one shared iterator: each pair is taken by exactly one worker
            sample_params = replace(params, n=1, seed=derive_seed(seed, i, j))
            result = await episode(sampler, env_factory(), rows[i], sample_params, max_turns)
            record = _sample_record(i, j, sample_params.seed, result, success_threshold)
            new.append(record)
            await writer.add(record)

    try:
        async with asyncio.TaskGroup() as group:  # the first failure cancels the other workers
            for _ in range(min(max_active, len(rows) * n - len(done))):
                group.create_task(work())
    except BaseExceptionGroup as failures:
        await writer.flush()  # keep what finished: a resume won't redo it
        raise _first_error(failures) from None
    await writer.flush()
    samples = sorted([*previous, *new], key=lambda s: (s.prompt_index, s.sample_index))
    return EvalResult(samples, summarize_samples(samples, ks=ks, seed=seed))


def summarize_samples(
    samples: Sequence[EvalSampleRecord], *, ks: Sequence[int] | None, seed: int
) -> EvalSummary:
    """`rollout.eval.metrics.summarize` over stored rows (what `--output` rows recompute)."""
    return summarize([to_outcome(s) for s in samples], ks=ks, seed=seed)


def to_outcome(sample: EvalSampleRecord | Mapping[str, Any]) -> SampleOutcome:
    """A stored row (record, or its `--output` JSON dict) as the metrics see it."""
    get = sample.get if isinstance(sample, Mapping) else lambda name: getattr(sample, name)
    return SampleOutcome(
        prompt_index=int(get("prompt_index")),
        sample_index=int(get("sample_index")),
        reward=get("reward"),
        success=bool(get("success")),
        answer=get("answer"),
        turns=int(get("turns")),
        tool_calls=int(get("tool_calls")),
        completion_tokens=int(get("completion_tokens")),
        truncated=bool(get("truncated")),
        failed=bool(get("failed")),
    )


def summary_to_dict(summary: EvalSummary) -> dict[str, Any]:
    """The JSON the store keeps in `evals.summary`."""
    return {
        "n_prompts": summary.n_prompts,
        "n_samples": summary.n_samples,
        "ks": list(summary.ks),
        "metrics": dict(summary.metrics),
        "not_computable": dict(summary.not_computable),
    }


def _sample_record(
    prompt_index: int, sample_index: int, seed: int, episode: Episode, success_threshold: float
) -> EvalSampleRecord:
    failed = episode.error is not None
    if not failed and not math.isfinite(episode.reward):
        raise RolloutError(
            f"the env returned a non-finite reward ({episode.reward}) for prompt {prompt_index},"
            f" sample {sample_index}"
        )
    last = episode.messages[-1] if episode.messages else None
    completion = last["content"] if last is not None and last.get("role") == "assistant" else None
    return EvalSampleRecord(
        prompt_index=prompt_index,
        sample_index=sample_index,
        seed=seed,
        reward=None if failed else episode.reward,
        success=not failed and episode.reward >= success_threshold,
        failed=failed,
        answer=None if failed else episode.answer,
        completion=completion,
        messages=[dict(m) for m in episode.messages],
        turns=episode.turns,
        tool_calls=episode.tool_calls,
        finish_reason=episode.finish_reason,
        prompt_tokens=episode.prompt_tokens,
        completion_tokens=episode.completion_tokens,
        truncated=episode.truncated,
        error=episode.error,
        created_at=time.time(),
    )


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first failure in a task group's exception group (the others are usually the same one)."""
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


class _BatchWriter:
    """Buffers finished samples; hands them to `sink` in batches, one batch at a time, off the loop."""

    def __init__(self, sink: Callable[[list[EvalSampleRecord]], None] | None) -> None:
        self._sink = sink
        self._buffer: list[EvalSampleRecord] = []
        self._lock = asyncio.Lock()
        self._last = time.monotonic()

    async def add(self, record: EvalSampleRecord) -> None:
        self._buffer.append(record)
        if len(self._buffer) >= WRITE_EVERY_SAMPLES or time.monotonic() - self._last >= WRITE_EVERY_S:
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            batch, self._buffer = self._buffer, []
            self._last = time.monotonic()
            if batch and self._sink is not None:
                await asyncio.to_thread(self._sink, batch)
