"""RL data types and interfaces (SPEC section 9): `Trajectory`, `Sample`, `RolloutBatch`, `Env`, `RewardFn`.

Everything the rollout side hands the learner is a frozen dataclass here;
`Env` and `RewardFn` are the two extension points (built-ins in `envs.py` and
`rewards.py`, user code through `module:attr` references). No torch here.

A sample whose reward could not be computed (the function raised, timed out,
answered badly, or every function abstained) is not an exception: it is a
`Sample` with `status="dropped"` and a `drop_reason`, so one bad completion or
one flaky scorer never stops a run.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rollout.inference.types import Message, Prompt

SampleStatus = Literal["ok", "dropped"]
RewardValues = list[float | None]
SegmentSource = Literal["prompt", "sampled", "env", "tool"]


# --- one episode, as tokens --------------------------------------------------------


@dataclass(frozen=True)
class TokenSegment:
    """A run of tokens from one source, within one turn of an episode.

    `sampled` tokens came from the policy and are the only ones trained on;
    they carry the sampler's log-probs (log p under the temperature-1
    distribution, as `Completion.logprobs`). `prompt`, `env` and `tool` tokens
    are context: rendered by the chat template or returned by the env / a
    tool, never re-tokenised from sampled text.
    """

    source: SegmentSource
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    """One per token for `sampled` segments; None for the others."""
    turn: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if self.source not in ("prompt", "sampled", "env", "tool"):
            raise ValueError(f"segment source must be prompt, sampled, env or tool, got {self.source!r}")
        if (self.source == "sampled") != (self.logprobs is not None):
            raise ValueError("a segment has log-probs exactly when its tokens were sampled")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.token_ids)} sampled tokens")


@dataclass(frozen=True)
class Trajectory:
    """The record of one episode: what was sampled is exactly what is trained and stored.

    `segments` in order make the whole token sequence (prompt, then per turn
    the sampled reply and any env / tool tokens); `turn_rewards` has one
    reward per finished turn, `reward` is the episode's return (None when it
    could not be computed). A single-turn sample is the special case
    `[prompt, sampled]` with one turn reward (`Sample.trajectory()`).
    """

    segments: tuple[TokenSegment, ...]
    turn_rewards: tuple[float, ...]
    reward: float | None
    finish_reason: str
    text: str
    """The sampled text as rendered (all sampled turns, in order)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "turn_rewards", tuple(float(r) for r in self.turn_rewards))

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for seg in self.segments for t in seg.token_ids)

    @property
    def loss_mask(self) -> tuple[bool, ...]:
        """True at sampled tokens: the only ones a policy loss may count."""
        return tuple(seg.source == "sampled" for seg in self.segments for _ in seg.token_ids)

    @property
    def num_turns(self) -> int:
        return 1 + max((seg.turn for seg in self.segments), default=0)

    def single_turn(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
        """(prompt ids, sampled ids, sampled log-probs) of a `[prompt, sampled]` trajectory."""
        kinds = [seg.source for seg in self.segments]
        if kinds != ["prompt", "sampled"]:
            raise ValueError(f"not a single-turn trajectory: segments {kinds}")
        prompt, sampled = self.segments
        assert sampled.logprobs is not None  # checked by TokenSegment
        return prompt.token_ids, sampled.token_ids, sampled.logprobs


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt, with its reward and everything the learner needs.

    `rollout_logprobs[i]` is the engine's log p(completion_token_ids[i] | prefix)
    under the temperature-1 distribution (for the importance-sampling ratio).
    `reward` is the weighted sum of the non-abstaining `reward_components`; it is
    None exactly when `status == "dropped"`.
    """

    prompt_index: int
    """Row index in the dataset."""
    group_id: int
    """All `num_generations` completions of one drawn prompt share a group id (unique per run)."""
    prompt: str | tuple[Message, ...]
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    completion_text: str
    rollout_logprobs: tuple[float, ...]
    finish_reason: str
    reward: float | None
    reward_components: Mapping[str, float | None]
    status: SampleStatus
    policy_version: int
    """The policy version the completion was sampled with (for max-staleness and off-policy corrections)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The dataset row's fields other than "prompt" (e.g. "answer")."""
    drop_reason: str | None = None
    completion_mask: tuple[bool, ...] | None = None
    """Multi-turn episodes: True at the tokens the policy sampled, False at env / tool tokens
    (whose `rollout_logprobs` are 0.0). None: every completion token was sampled (single turn)."""
    turn_rewards: tuple[float, ...] = ()
    """Multi-turn episodes: one reward per assistant turn (their sum is `reward`); () for single turn."""
    episode: Mapping[str, Any] = field(default_factory=dict)
    """Multi-turn episodes: turns, tool_calls, tool_errors, truncated, env_error."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(dict(m) for m in self.prompt))
        for name in ("prompt_token_ids", "completion_token_ids"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        object.__setattr__(self, "rollout_logprobs", tuple(float(x) for x in self.rollout_logprobs))
        if len(self.rollout_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.rollout_logprobs)} log-probs for"
                f" {len(self.completion_token_ids)} completion tokens"
            )
        if self.status not in ("ok", "dropped"):
            raise ValueError(f"sample status must be 'ok' or 'dropped', got {self.status!r}")
        if (self.status == "ok") != (self.reward is not None):
            raise ValueError("a sample has a reward exactly when its status is 'ok'")
        if self.completion_mask is not None:
            object.__setattr__(self, "completion_mask", tuple(bool(m) for m in self.completion_mask))
            if len(self.completion_mask) != len(self.completion_token_ids):
                raise ValueError(
                    f"sample of group {self.group_id}: a completion mask of {len(self.completion_mask)} for"
                    f" {len(self.completion_token_ids)} completion tokens"
                )
        object.__setattr__(self, "turn_rewards", tuple(float(r) for r in self.turn_rewards))
        if self.turn_rewards and len(self.turn_rewards) != len(self.turn_ends):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.turn_rewards)} turn rewards for"
                f" {len(self.turn_ends)} sampled turns"
            )

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def loss_mask(self) -> tuple[bool, ...]:
        """True at the completion tokens a policy loss counts (the sampled ones)."""
        return self.completion_mask if self.completion_mask is not None else (True,) * len(self.completion_token_ids)

    @property
    def turn_ends(self) -> tuple[int, ...]:
        """Index into the completion of each sampled turn's last token (one per turn reward)."""
        mask = self.loss_mask
        return tuple(i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1]))

    def trajectory(self) -> Trajectory:
        """This sample as a `Trajectory` (exact: for a single-turn sample `single_turn()` gives back
        the token ids and log-probs). The snapshot format stays `to_dict`'s, so old snapshots resume
        unchanged."""
        if self.completion_mask is not None:
            return self._episode_trajectory()
        return Trajectory(
            segments=(
                TokenSegment("prompt", self.prompt_token_ids),
                TokenSegment("sampled", self.completion_token_ids, self.rollout_logprobs),
            ),
            turn_rewards=() if self.reward is None else (self.reward,),
            reward=self.reward,
            finish_reason=self.finish_reason,
            text=self.completion_text,
        )

    def _episode_trajectory(self) -> Trajectory:
        assert self.completion_mask is not None
        segments = [TokenSegment("prompt", self.prompt_token_ids)]
        turn, start = 0, 0
        mask = self.completion_mask
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                ids = self.completion_token_ids[start:i]
                if mask[start]:
                    segments.append(TokenSegment("sampled", ids, self.rollout_logprobs[start:i], turn=turn))
                else:
                    segments.append(TokenSegment("env", ids, turn=turn))
                    turn += 1
                start = i
        return Trajectory(
            segments=tuple(segments), turn_rewards=self.turn_rewards, reward=self.reward,
            finish_reason=self.finish_reason, text=self.completion_text,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists); `from_dict` inverts it. Episode fields appear only
        on multi-turn samples, so single-turn snapshots keep their old shape."""
        episode: dict[str, Any] = {}
        if self.completion_mask is not None:
            episode = {
                "completion_mask": [int(m) for m in self.completion_mask],
                "turn_rewards": list(self.turn_rewards),
                "episode": dict(self.episode),
            }
        return {
            "prompt_index": self.prompt_index,
            "group_id": self.group_id,
            "prompt": self.prompt if isinstance(self.prompt, str) else [dict(m) for m in self.prompt],
            "prompt_token_ids": list(self.prompt_token_ids),
            "completion_token_ids": list(self.completion_token_ids),
            "completion_text": self.completion_text,
            # JSON has no inf: a -inf log-prob (top-k/top-p never sample one, but be safe) goes as a string.
            "rollout_logprobs": [x if math.isfinite(x) else repr(x) for x in self.rollout_logprobs],
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "reward_components": dict(self.reward_components),
            "status": self.status,
            "policy_version": self.policy_version,
            "metadata": dict(self.metadata),
            "drop_reason": self.drop_reason,
        } | episode

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        prompt = data["prompt"]
        return cls(
            prompt_index=int(data["prompt_index"]),
            group_id=int(data["group_id"]),
            prompt=prompt if isinstance(prompt, str) else tuple(dict(m) for m in prompt),
            prompt_token_ids=tuple(data["prompt_token_ids"]),
            completion_token_ids=tuple(data["completion_token_ids"]),
            completion_text=str(data["completion_text"]),
            rollout_logprobs=tuple(float(x) for x in data["rollout_logprobs"]),
            finish_reason=str(data["finish_reason"]),
            reward=None if data["reward"] is None else float(data["reward"]),
            reward_components=dict(data["reward_components"]),
            status=data["status"],
            policy_version=int(data["policy_version"]),
            metadata=dict(data.get("metadata") or {}),
            drop_reason=data.get("drop_reason"),
            completion_mask=None if data.get("completion_mask") is None else tuple(
                bool(m) for m in data["completion_mask"]),
            turn_rewards=tuple(float(r) for r in data.get("turn_rewards") or ()),
            episode=dict(data.get("episode") or {}),
        )


@dataclass(frozen=True)
class RolloutBatch:
    """The groups of one training step.

    `samples` holds `num_prompts` groups, each contiguous and in choice order;
    dropped samples stay in their group (status "dropped", reward None), so
    losses must use `ok_samples()` / `groups()`. A batch can be short (or
    empty) when over-sampling ran out of rounds: check `num_prompts`.
    """

    samples: tuple[Sample, ...]
    num_prompts: int
    policy_version: int
    """The oldest policy version among the samples."""
    metrics: Mapping[str, float]

    def groups(self, *, ok_only: bool = True) -> list[tuple[Sample, ...]]:
        """The samples grouped by `group_id`, in batch order (only status "ok" ones by default)."""
        out: list[tuple[Sample, ...]] = []
        for _, group in _runs_by_group(self.samples):
            kept = tuple(s for s in group if s.ok or not ok_only)
            if kept:
                out.append(kept)
        return out

    def ok_samples(self) -> tuple[Sample, ...]:
        return tuple(s for s in self.samples if s.ok)


def _runs_by_group(samples: Sequence[Sample]) -> Iterator[tuple[int, list[Sample]]]:
    current: list[Sample] = []
    for sample in samples:
        if current and sample.group_id != current[0].group_id:
            yield current[0].group_id, current
            current = []
        current.append(sample)
    if current:
        yield current[0].group_id, current


# --- extension points -------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """What an env answers to one assistant message.

    `messages` are the new turns to append before the next assistant turn (a
    tool result, the user's reply; empty when `done`). `reward` is this step's
    reward; an episode's return is the sum over its steps.
    """

    messages: tuple[Message, ...]
    reward: float
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode of an async, possibly multi-turn environment.

    `reset(row)` starts an episode from a dataset row and returns the opening
    messages; then `step(assistant_message)` until `done`. One env object runs
    one episode at a time; an `EnvFactory` makes a fresh one per episode.
    """

    async def reset(self, row: Mapping[str, Any]) -> list[Message]: ...

    async def step(self, assistant_message: Message) -> StepResult: ...


EnvFactory = Callable[[], Env]


@runtime_checkable
class RewardFn(Protocol):
    """A batched reward function (TRL style), sync or async.

    Gets the prompts (text or message lists), the completion texts and every
    other dataset field as a list aligned with them (e.g. `answer=[...]`).
    Returns one float per completion, or None to abstain on that completion.
    Functions without `**kwargs` only receive the fields they name.
    """

    def __call__(
        self, prompts: list[Prompt], completions: list[str], **fields: list[Any]
    ) -> RewardValues | Awaitable[RewardValues]: ...


RewardSpec = tuple[str, RewardFn, float]
"""(name, function, weight): a reward function as the manager and `score_batch` take it."""

EventHook = Callable[[str, dict[str, Any]], None]
