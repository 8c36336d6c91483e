"""Multi-turn episodes, token-in/token-out (SPEC section 9).

    episodes = await run_episodes(sampler, tokenizer, env_factory, [(group_id, row), ...],
                                  num_generations=8, sampling=SamplingParams(temperature=1.0, max_tokens=48),
                                  seed=0, limits=EpisodeLimits(max_turns=4, max_episode_tokens=256))
    episodes[g][j].trajectory()          # segments prompt / sampled / tool / env, per-turn rewards

An episode is one token record. The prompt is rendered once by the chat
template (with the env's tools, if it has any). Each turn, the policy's
tokens are kept exactly as the engine sampled them, with their log-probs;
the env's answer (tool results, a user turn) is tokenised once, as the chat
template renders it appended to the conversation (`chat_tokens`), and
appended. Sampled text is never re-tokenised, so what is trained is exactly
what was sampled (`Episode.completion_mask` marks the sampled tokens).

Turns are synchronous across the episodes of a call: every live episode's
next turn goes to the sampler in one `submit_all` (one engine batch), then
the env steps run concurrently (at most `limits.max_concurrent_steps`, each
within `limits.step_timeout_s`). The batch an episode's turn lands in depends
only on the inputs, so a run and its resume sample the same tokens. Turn `t`
of choice `j` of group `g` is seeded with `derive_seed(seed, g, j, t)`.

Every turn but the last asks the engine to keep its key/value cache under the
episode's `cache_key`, and the next turn continues from it: the hf engine
then prefills only the last sampled token and the env's answer, not the whole
conversation again (`inference/kept_cache.py`; other engines ignore the key).
What is left (episodes the env ended early) is released when the call's
episodes end.

An episode ends when the env says `done` (finish reason "done"), after
`max_turns` assistant turns ("max_turns"), when the next turn would exceed
`max_episode_tokens` tokens after the prompt ("max_episode_tokens"), or when
the env raised, timed out or answered something that is not a `StepResult`
("env_error": reward 0, the episode's tokens still recorded). The two limits
are `truncated`: counted, and rewarded with the sum of the turn rewards they
earned, never a made-up final score. A reply cut by `max_tokens` still goes
to the env, which decides (a half-written tool call is the env's to judge);
if the episode goes on, the template's end-of-turn token is appended as
context (source "env"), so the record stays a valid conversation.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from rollout.errors import ConfigError
from rollout.inference.sampler import RequestSampler
from rollout.inference.types import Completion, GenerationRequest, Message, SamplingParams, derive_seed
from rollout.rl.chat_tokens import continuation_ids, prompt_ids
from rollout.rl.types import EnvFactory, Sample, StepResult, TokenSegment, Trajectory

EpisodeEnd = Literal["done", "max_turns", "max_episode_tokens", "env_error"]
TRUNCATED: frozenset[str] = frozenset({"max_turns", "max_episode_tokens"})
T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeLimits:
    """When an episode stops, and how its env is run."""

    max_turns: int = 1
    """Assistant turns per episode."""
    max_episode_tokens: int = 512
    """Tokens after the prompt (sampled + env + tool); a turn never starts past it."""
    step_timeout_s: float = 30.0
    """Per `env.reset` / `env.step` call."""
    max_concurrent_steps: int = 32

    def __post_init__(self) -> None:
        problems = []
        if self.max_turns < 1:
            problems.append(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 1:
            problems.append(f"max_episode_tokens must be >= 1, got {self.max_episode_tokens}")
        if not (math.isfinite(self.step_timeout_s) and self.step_timeout_s > 0):
            problems.append(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.max_concurrent_steps < 1:
            problems.append(f"max_concurrent_steps must be >= 1, got {self.max_concurrent_steps}")
        if problems:
            raise ConfigError(f"invalid episode limits: {problems[0]}", details=problems[1:])


@dataclass(frozen=True)
class EpisodeSetup:
    """What the rollout manager needs to run episodes instead of scoring single replies."""

    tokenizer: Any
    env_factory: EnvFactory
    limits: EpisodeLimits


@dataclass(frozen=True)
class Episode:
    """One finished episode: the prompt, then per turn the sampled reply and the env's answer."""

    group_id: int
    index: int
    """Choice `j` within its group."""
    prompt_ids: tuple[int, ...]
    segments: tuple[TokenSegment, ...]
    """After the prompt, in order: `sampled` (with log-probs), `tool` / `env` (context)."""
    turn_rewards: tuple[float, ...]
    reward: float
    finish_reason: EpisodeEnd
    messages: tuple[Message, ...]
    """The conversation as text: the env's opening messages, then every turn."""
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None
    """Why the env failed (finish reason "env_error")."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason in TRUNCATED

    @property
    def num_turns(self) -> int:
        return sum(seg.source == "sampled" for seg in self.segments)

    @property
    def completion_ids(self) -> tuple[int, ...]:
        return tuple(t for seg in self.segments for t in seg.token_ids)

    @property
    def completion_mask(self) -> tuple[bool, ...]:
        """True at sampled tokens: the only ones a policy loss counts."""
        return tuple(seg.source == "sampled" for seg in self.segments for _ in seg.token_ids)

    @property
    def completion_logprobs(self) -> tuple[float, ...]:
        """The sampler's log-probs at sampled tokens, 0.0 at env / tool tokens (masked out)."""
        return tuple(
            x for seg in self.segments for x in (seg.logprobs if seg.logprobs is not None else [0.0] * len(seg.token_ids))
        )

    @property
    def text(self) -> str:
        """The sampled replies, in order, one per line."""
        return "\n".join(str(m["content"]) for m in self.messages if m.get("role") == "assistant")

    @property
    def turn_ends(self) -> tuple[int, ...]:
        """Index (into `completion_ids`) of each turn's last sampled token, one per turn reward."""
        ends, pos = [], 0
        for seg in self.segments:
            pos += len(seg.token_ids)
            if seg.source == "sampled":
                ends.append(pos - 1)
        return tuple(ends)

    def trajectory(self) -> Trajectory:
        return Trajectory(
            segments=(TokenSegment("prompt", self.prompt_ids), *self.segments),
            turn_rewards=self.turn_rewards,
            reward=self.reward,
            finish_reason=self.finish_reason,
            text=self.text,
        )


@dataclass
class _Live:
    """An episode in progress."""

    group_id: int
    index: int
    env: Any
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    segments: list[TokenSegment] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    completion_len: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: EpisodeEnd | None = None
    error: str | None = None

    @property
    def turn(self) -> int:
        return len(self.turn_rewards)

    def add(self, segment: TokenSegment) -> None:
        if segment.token_ids:
            self.segments.append(segment)
            self.completion_len += len(segment.token_ids)

    def fail(self, why: str) -> None:
        self.end, self.error = "env_error", why

    def finished(self) -> Episode:
        assert self.end is not None
        reward = 0.0 if self.end == "env_error" else math.fsum(self.turn_rewards)
        return Episode(
            group_id=self.group_id, index=self.index, prompt_ids=tuple(self.prompt_ids),
            segments=tuple(self.segments), turn_rewards=tuple(self.turn_rewards), reward=reward,
            finish_reason=self.end, messages=tuple(self.messages), tool_calls=self.tool_calls,
            tool_errors=self.tool_errors, error=self.error,
        )


async def run_episodes(
    sampler: RequestSampler,
    tokenizer: Any,
    env_factory: EnvFactory,
    starts: Sequence[tuple[int, Mapping[str, Any]]],
    *,
    num_generations: int,
    sampling: SamplingParams,
    seed: int,
    limits: EpisodeLimits,
) -> list[list[Episode]]:
    """`num_generations` episodes per `(group_id, row)`, all run together; one list per start, choice order."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ConfigError("multi-turn episodes need a tokenizer with an eos token (it ends each assistant turn)")
    slots = asyncio.Semaphore(limits.max_concurrent_steps)
    live = [_Live(gid, j, env_factory()) for gid, _ in starts for j in range(num_generations)]
    rows = [row for _, row in starts for _ in range(num_generations)]
    await asyncio.gather(*(_reset(ep, row, tokenizer, slots, limits) for ep, row in zip(live, rows, strict=True)))

    scope = f"episodes-{uuid.uuid4().hex}/"
    try:
        await _run_turns(sampler, tokenizer, live, eos_id, slots, sampling=sampling, seed=seed, limits=limits, scope=scope)
    finally:
        release = getattr(sampler, "release_cache", None)
        if release is not None:
            release(scope)

    episodes = [ep.finished() for ep in live]
    return [episodes[i : i + num_generations] for i in range(0, len(episodes), num_generations)]


async def _run_turns(
    sampler: RequestSampler, tokenizer: Any, live: list[_Live], eos_id: int, slots: asyncio.Semaphore, *,
    sampling: SamplingParams, seed: int, limits: EpisodeLimits, scope: str,
) -> None:
    """Turn after turn until every episode has ended; turn t of every live episode in one engine batch."""
    running = [ep for ep in live if ep.end is None]
    while running:
        asking = []
        for ep in running:
            room = limits.max_episode_tokens - ep.completion_len
            if room < 1:
                ep.end = "max_episode_tokens"
                continue
            params = replace(sampling, n=1, max_tokens=min(sampling.max_tokens, room),
                             seed=derive_seed(seed, ep.group_id, ep.index, ep.turn))
            asking.append((ep, GenerationRequest(
                prompt_token_ids=(*ep.prompt_ids, *_ids(ep.segments)), params=params,
                cache_key=f"{scope}{ep.group_id}/{ep.index}", keep_cache=ep.turn + 1 < limits.max_turns,
            )))
        if asking:
            outputs = await asyncio.gather(*sampler.submit_all([request for _, request in asking]))
            await asyncio.gather(*(
                _after_turn(ep, choices[0], tokenizer, eos_id, slots, limits)
                for (ep, _), choices in zip(asking, outputs, strict=True)
            ))
        running = [ep for ep in running if ep.end is None]


def _ids(segments: Sequence[TokenSegment]) -> tuple[int, ...]:
    return tuple(t for seg in segments for t in seg.token_ids)


async def _bounded(slots: asyncio.Semaphore, call: Awaitable[T], timeout_s: float) -> T:
    async with slots:
        return await asyncio.wait_for(call, timeout_s)


async def _reset(ep: _Live, row: Mapping[str, Any], tokenizer: Any, slots: asyncio.Semaphore, limits: EpisodeLimits) -> None:
    try:
        opening = await _bounded(slots, ep.env.reset(row), limits.step_timeout_s)
    except Exception as err:  # noqa: BLE001 - any env failure ends its episode, never the run
        ep.fail(_describe(err, "reset"))
        return
    if not _is_messages(opening) or not opening:
        ep.fail("reset returned no chat messages")
        return
    tools = getattr(ep.env, "tools", None)
    ep.tools = [t.openai_schema() for t in tools] if tools else None
    ep.messages = [dict(m) for m in opening]
    ep.prompt_ids = list(prompt_ids(tokenizer, ep.messages, tools=ep.tools))


async def _after_turn(
    ep: _Live, reply: Completion, tokenizer: Any, eos_id: int, slots: asyncio.Semaphore, limits: EpisodeLimits
) -> None:
    """Record the sampled reply, step the env, and append its answer (or end the episode)."""
    turn = ep.turn
    ep.add(TokenSegment("sampled", reply.token_ids, reply.logprobs, turn=turn))
    message = {"role": "assistant", "content": reply.text}
    ep.messages.append(message)
    try:
        result = await _bounded(slots, ep.env.step(message), limits.step_timeout_s)
        if not isinstance(result, StepResult) or not math.isfinite(float(result.reward)):
            raise TypeError(f"step must return a StepResult with a finite reward, got {result!r:.200}")
        answer = [dict(m) for m in result.messages]
        if not _is_messages(answer):
            raise TypeError("the StepResult's messages are not chat messages")
    except Exception as err:  # noqa: BLE001 - any env failure ends its episode, never the run
        ep.turn_rewards.append(0.0)
        ep.fail(_describe(err, "step"))
        return
    ep.turn_rewards.append(float(result.reward))
    ep.tool_calls += int(result.info.get("tool_calls", 0) or 0)
    ep.tool_errors += int(result.info.get("tool_errors", 0) or 0)
    if result.done:
        ep.end = "done"
    elif ep.turn >= limits.max_turns:
        ep.end = "max_turns"
    else:
        closing = [] if reply.token_ids and reply.token_ids[-1] == eos_id else [eos_id]
        tokens = closing + continuation_ids(tokenizer, answer, tools=ep.tools)
        if ep.completion_len + len(tokens) >= limits.max_episode_tokens:
            ep.end = "max_episode_tokens"
            return
        source = "tool" if answer and all(m.get("role") == "tool" for m in answer) else "env"
        ep.add(TokenSegment(source, tokens, turn=turn))
        ep.messages.extend(answer)


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _describe(err: BaseException, where: str) -> str:
    if isinstance(err, TimeoutError):
        return f"env {where} timed out"
    return f"env {where} raised {type(err).__name__}: {err}"[:500]


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """`episode/*` and `tools/*` means over finished episodes (turns, tokens, tool use, truncation, env errors)."""
    return _metrics([
        (e.num_turns, len(e.completion_mask), sum(e.completion_mask), e.tool_calls, e.tool_errors, e.finish_reason)
        for e in episodes
    ])


def sample_episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`episode_metrics` of the episodes behind multi-turn samples (`episode_sample`)."""
    return _metrics([
        (int(s.episode.get("turns", 0)), len(s.completion_token_ids), sum(s.loss_mask),
         int(s.episode.get("tool_calls", 0)), int(s.episode.get("tool_errors", 0)), s.finish_reason)
        for s in samples
    ])


def _metrics(records: Sequence[tuple[int, int, int, int, int, str]]) -> dict[str, float]:
    if not records:
        return {}
    n = len(records)
    calls = sum(r[3] for r in records)
    out = {
        "episode/turns_mean": sum(r[0] for r in records) / n,
        "episode/tokens_mean": sum(r[1] for r in records) / n,
        "episode/sampled_tokens_mean": sum(r[2] for r in records) / n,
        "episode/truncated_frac": sum(r[5] in TRUNCATED for r in records) / n,
        "episode/env_errors": float(sum(r[5] == "env_error" for r in records)),
        "tools/calls_per_episode": calls / n,
    }
    if calls:
        out["tools/error_rate"] = sum(r[4] for r in records) / calls
    for end in ("done", "max_turns", "max_episode_tokens"):
        out[f"episode/end/{end}"] = sum(r[5] == end for r in records) / n
    return out


def episode_sample(episode: Episode, row: Mapping[str, Any], prompt_index: int, policy_version: int) -> Sample:
    """One finished episode as the learner's `Sample` (prompt = the rendered opening, completion =
    everything after it, `completion_mask` = the sampled tokens). An env that failed before the
    episode had a prompt gives a dropped sample."""
    dropped = not episode.prompt_ids or not any(episode.completion_mask)
    return Sample(
        prompt_index=prompt_index,
        group_id=episode.group_id,
        prompt=row.get("prompt", ""),
        prompt_token_ids=episode.prompt_ids,
        completion_token_ids=episode.completion_ids,
        completion_text=episode.text,
        rollout_logprobs=episode.completion_logprobs,
        finish_reason=episode.finish_reason,
        reward=None if dropped else episode.reward,
        reward_components={} if dropped else {"env": episode.reward},
        status="dropped" if dropped else "ok",
        policy_version=policy_version,
        metadata={k: v for k, v in row.items() if k != "prompt"},
        drop_reason=(episode.error or "the episode has no sampled tokens") if dropped else None,
        completion_mask=episode.completion_mask,
        turn_rewards=episode.turn_rewards,
        episode={
            "turns": episode.num_turns, "tool_calls": episode.tool_calls, "tool_errors": episode.tool_errors,
            "truncated": episode.truncated, "env_error": episode.finish_reason == "env_error",
        },
    )
