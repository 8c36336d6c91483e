"""Built-in reward functions, their resolution from config, and `score_batch`.

    fns = [("correct", resolve_reward("arithmetic_correct"), 1.0),
           ("format", resolve_reward("format_answer_only"), 0.1)]
    rewards, components, failures = await score_batch(
        fns, prompts, completions, {"answer": answers}, timeout_s=30.0)

Reward functions are batched and TRL-shaped: `fn(prompts, completions,
**fields) -> list[float | None]`, sync or async; None abstains. `score_batch`
never raises: a function that raises, times out or answers badly fails the
whole batch it was given (it is batched), and those samples carry the reason
in `failures` instead of a reward. The manager drops them ("failures as data").

Sync functions run in a daemon thread each: a hung sync function can't be
killed, but it then neither blocks the event loop nor interpreter exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
import threading
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from rollout.errors import ConfigError
from rollout.inference.types import Prompt
from rollout.plugins import find_plugin, unknown_name_error
from rollout.rl.math_answer import math_answers_match
from rollout.rl.refs import is_ref, load_ref
from rollout.rl.types import RewardFn, RewardSpec, RewardValues
from rollout.sidecar import Sidecar, SidecarReward
from rollout.sidecar_config import SidecarConfig
from rollout.tasks.arithmetic import is_correct

_NUMBER_ONLY = r"[-+]?\d+(?:\.\d+)?"


# --- built-ins ------------------------------------------------------------------------


def arithmetic_correct(
    prompts: list[Prompt], completions: list[str], answer: list[Any] | None = None, **_: list[Any]
) -> RewardValues:
    """1.0 when the completion's first integer equals the row's "answer" (the arithmetic task), else 0.0."""
    answers = _need_field("arithmetic_correct", "answer", answer)
    return [1.0 if is_correct(c, str(a)) else 0.0 for c, a in zip(completions, answers, strict=True)]


def math_answer(
    prompts: list[Prompt], completions: list[str], answer: list[Any] | None = None, **_: list[Any]
) -> RewardValues:
    """1.0 when the completion's final answer (boxed / "answer is" / last number) matches "answer"."""
    answers = _need_field("math_answer", "answer", answer)
    return [1.0 if math_answers_match(c, str(a)) else 0.0 for c, a in zip(completions, answers, strict=True)]


def format_answer_only(prompts: list[Prompt], completions: list[str], **_: list[Any]) -> RewardValues:
    """1.0 when the completion is just a number ("11", " -3 ", "2.5"), else 0.0: a shaping term."""
    return [1.0 if re.fullmatch(_NUMBER_ONLY, c.strip()) else 0.0 for c in completions]


def _need_field(fn: str, field: str, values: list[Any] | None) -> list[Any]:
    if values is None:
        raise ConfigError(f'reward function {fn} needs a "{field}" field in every prompt row')
    if any(v is None for v in values):
        raise ConfigError(f'reward function {fn}: some prompt rows have no "{field}" field')
    return values


def resolve_reward(name: str | SidecarConfig) -> RewardFn:
    """A built-in or plugin reward name (`rollout.plugins`), a `module:attr` reference, or a sidecar
    table, as a reward function (`ConfigError` otherwise). A sidecar starts on its first call."""
    if isinstance(name, SidecarConfig):
        return SidecarReward(Sidecar.from_config(name), name=name.label)
    plugin = find_plugin("reward", name)
    if plugin is not None:
        return plugin.load_callable()  # type: ignore[return-value]
    if is_ref(name):
        return load_ref(name, what="reward function")  # type: ignore[return-value]
    raise unknown_name_error("reward", name)


# --- scoring --------------------------------------------------------------------------


async def score_batch(
    fns: Sequence[RewardSpec],
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]],
    *,
    timeout_s: float,
) -> tuple[list[float | None], list[dict[str, float | None]], list[str | None]]:
    """Run every reward function on the batch concurrently; combine with weights.

    Returns, per sample: the weighted sum of the non-None components (None when
    every function abstained or one failed), the components by name (None for
    abstain / failure), and the failure reason (None when every function answered).
    """
    n = len(completions)
    if len(prompts) != n or any(len(v) != n for v in fields.values()):
        raise ValueError("score_batch: prompts, completions and every field need the same length")
    answers = await asyncio.gather(
        *(
            _run_reward_fn(name, fn, list(prompts), list(completions), fields, timeout_s)
            for name, fn, _ in fns
        )
    )
    rewards: list[float | None] = []
    components: list[dict[str, float | None]] = []
    failures: list[str | None] = []
    for i in range(n):
        parts: dict[str, float | None] = {}
        reasons: list[str] = []
        total, answered = 0.0, False
        for (name, _, weight), (values, error) in zip(fns, answers, strict=True):
            if error is not None:
                parts[name] = None
                reasons.append(error)
                continue
            assert values is not None
            parts[name] = values[i]
            if values[i] is not None:
                total += weight * values[i]
                answered = True
        components.append(parts)
        failures.append("; ".join(reasons) if reasons else None)
        rewards.append(total if answered and not reasons else None)
    return rewards, components, failures


async def _run_reward_fn(
    name: str,
    fn: RewardFn,
    prompts: list[Prompt],
    completions: list[str],
    fields: Mapping[str, Sequence[Any]],
    timeout_s: float,
) -> tuple[list[float | None] | None, str | None]:
    """(values, None) or (None, reason): one function on the whole batch, with a timeout."""
    kwargs = {k: list(v) for k, v in _accepted_fields(fn, fields).items()}
    try:
        async with asyncio.timeout(timeout_s):
            if _is_async(fn):
                answer = await fn(prompts, completions, **kwargs)  # type: ignore[misc]
            else:
                answer = await _in_daemon_thread(fn, prompts, completions, **kwargs)
                if inspect.isawaitable(answer):
                    answer = await answer
    except TimeoutError:
        return None, f"reward fn {name} timed out after {timeout_s:g}s"
    except Exception as err:  # any user-code failure becomes data; the run goes on
        return None, f"reward fn {name} raised {type(err).__name__}: {err}"
    if hasattr(answer, "tolist") and not isinstance(answer, Sequence):  # numpy array / torch tensor
        answer = answer.tolist()
    problem = _check_answer(answer, len(completions))
    if problem is not None:
        return None, f"bad answer from reward fn {name}: {problem}"
    return [None if v is None else float(v) for v in answer], None  # type: ignore[union-attr]


def _check_answer(answer: object, n: int) -> str | None:
    if isinstance(answer, str | bytes | Mapping) or not isinstance(answer, Sequence):
        return f"expected a list of {n} floats or None, got {type(answer).__name__}"
    if len(answer) != n:
        return f"expected {n} values (one per completion), got {len(answer)}"
    for i, value in enumerate(answer):
        if value is None:
            continue
        if not isinstance(value, Real):
            return f"value {i} is {type(value).__name__}, not a number or None"
        if not math.isfinite(float(value)):
            return f"value {i} is {float(value)}, not finite"
    return None


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _accepted_fields(fn: object, fields: Mapping[str, Sequence[Any]]) -> Mapping[str, Sequence[Any]]:
    """All fields for a function with **kwargs; otherwise only the ones it names."""
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return fields
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fields
    return {k: v for k, v in fields.items() if k in params}


async def _in_daemon_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a fresh daemon thread (unlike `to_thread`, a hang can't block exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as err:  # handed to the awaiting coroutine, not swallowed
            outcome = (False, err)
        # RuntimeError: the loop closed while a timed-out call hung, so nobody waits for the result.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="reward-fn", daemon=True).start()
    return await future
