"""Built-in single-turn verifiable envs, the env registry, and envs as reward functions.

    env = ArithmeticEnv()
    messages = await env.reset({"prompt": [{"role": "user", "content": "What is 3+8?"}], "answer": "11"})
    result = await env.step({"role": "assistant", "content": "11"})   # StepResult(reward=1.0, done=True)

    factory = resolve_env("math")                       # or "my_pkg.envs:ChessEnv"
    reward_fn = reward_from_env(factory)                # a batched async RewardFn

An env reference in config is a built-in or plugin name (`rl/builtins.py`, `rollout.plugins`),
a `module:attr` naming an `EnvFactory` (a class or a function returning an `Env`), or a
sidecar table (`rollout.sidecar`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rollout.errors import ConfigError
from rollout.inference.types import Message, Prompt
from rollout.plugins import find_plugin, unknown_name_error
from rollout.rl.math_answer import extract_math_answer, math_answers_match
from rollout.rl.refs import is_ref, load_ref
from rollout.rl.types import Env, EnvFactory, RewardFn, RewardValues, StepResult
from rollout.sidecar import Sidecar, SidecarEnvFactory
from rollout.sidecar_config import SidecarConfig
from rollout.tasks.arithmetic import extract_answer, is_correct


def prompt_messages(prompt: Prompt) -> list[Message]:
    """A dataset prompt as chat messages (a text prompt becomes one user turn)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _answer_of(row: Mapping[str, Any], env_name: str) -> str:
    if "answer" not in row:
        raise ConfigError(f'the {env_name} env needs an "answer" field in every prompt row')
    return str(row["answer"])


class ArithmeticEnv:
    """The shared arithmetic task: reward 1.0 when the completion's first integer is the answer."""

    def __init__(self) -> None:
        self._answer: str | None = None

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self._answer = _answer_of(row, "arithmetic")
        return prompt_messages(row["prompt"])

    async def step(self, assistant_message: Message) -> StepResult:
        if self._answer is None:
            raise RuntimeError("ArithmeticEnv.step called before reset")
        completion = assistant_message["content"]
        correct = is_correct(completion, self._answer)
        return StepResult((), 1.0 if correct else 0.0, True, {"extracted": extract_answer(completion)})


class MathAnswerEnv:
    """Final-answer math: reward 1.0 when the extracted, normalised answer equals row["answer"]."""

    def __init__(self) -> None:
        self._answer: str | None = None

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self._answer = _answer_of(row, "math")
        return prompt_messages(row["prompt"])

    async def step(self, assistant_message: Message) -> StepResult:
        if self._answer is None:
            raise RuntimeError("MathAnswerEnv.step called before reset")
        completion = assistant_message["content"]
        correct = math_answers_match(completion, self._answer)
        return StepResult((), 1.0 if correct else 0.0, True, {"extracted": extract_math_answer(completion)})


def resolve_env(name: str | SidecarConfig) -> EnvFactory:
    """A built-in or plugin env name (`rollout.plugins`), a `module:attr` reference, or a sidecar
    table, as an env factory (`ConfigError` otherwise). A sidecar starts on its first call."""
    if isinstance(name, SidecarConfig):
        return SidecarEnvFactory(Sidecar.from_config(name))
    plugin = find_plugin("env", name)
    if plugin is not None:
        return plugin.load_callable()  # type: ignore[return-value]
    if is_ref(name):
        return load_ref(name, what="env")  # type: ignore[return-value]
    raise unknown_name_error("env", name, builtin_noun="env ")


def reward_from_env(env_factory: EnvFactory, *, name: str = "env") -> RewardFn:
    """A batched async reward function scoring each completion with a fresh single-turn episode.

    Row i is rebuilt as `{"prompt": prompts[i], **{field: values[i]}}`; the env
    must finish in one step (a multi-turn env raises `ConfigError`, which
    `score_batch` reports as that function's failure).
    """

    async def score_one(prompt: Prompt, completion: str, row_fields: dict[str, Any]) -> float:
        env: Env = env_factory()
        await env.reset({"prompt": prompt, **row_fields})
        result = await env.step({"role": "assistant", "content": completion})
        if not result.done:
            raise ConfigError(f"env {name!r} is multi-turn: it cannot serve as a single-turn reward function")
        return float(result.reward)

    async def env_reward(prompts: list[Prompt], completions: list[str], **fields: list[Any]) -> RewardValues:
        rows = [{key: values[i] for key, values in fields.items()} for i in range(len(completions))]
        scores = await asyncio.gather(
            *(score_one(p, c, r) for p, c, r in zip(prompts, completions, rows, strict=True))
        )
        return list(scores)

    env_reward.__name__ = f"{name}_env_reward"
    return env_reward
