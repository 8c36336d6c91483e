"""Reward functions: built-ins, resolution, and score_batch's failure handling (never raises)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollout.errors import ConfigError
from rollout.rl.builtins import BUILTIN_REWARDS
from rollout.rl.rewards import (
    arithmetic_correct,
    format_answer_only,
    math_answer,
    resolve_reward,
    score_batch,
)

PROMPTS = ["What is 3+8?", "What is 1+1?", "What is 2+2?"]
COMPLETIONS = ["11", "The sum is 3", "4"]
FIELDS = {"answer": ["11", "2", "4"]}


def score(fns, *, timeout_s: float = 5.0, completions=COMPLETIONS, fields=FIELDS):
    return asyncio.run(
        score_batch(fns, PROMPTS[: len(completions)], completions, fields, timeout_s=timeout_s)
    )


def test_built_in_rewards() -> None:
    assert arithmetic_correct(PROMPTS, COMPLETIONS, **FIELDS) == [1.0, 0.0, 1.0]
    assert math_answer(PROMPTS, COMPLETIONS, **FIELDS) == [1.0, 0.0, 1.0]
    assert format_answer_only(PROMPTS, ["11", "The sum is 3", " -4.5 "]) == [1.0, 0.0, 1.0]
    with pytest.raises(ConfigError, match='needs a "answer" field'):
        arithmetic_correct(PROMPTS, COMPLETIONS)


def test_resolve_reward() -> None:
    assert resolve_reward("arithmetic_correct") is arithmetic_correct
    assert set(BUILTIN_REWARDS) >= {"arithmetic_correct", "math_answer", "format_answer_only"}
    from rl_helpers import length_reward

    assert resolve_reward("rl_helpers:length_reward") is length_reward
    with pytest.raises(ConfigError, match=r"unknown reward function 'acurracy': expected a built-in \(arith"):
        resolve_reward("acurracy")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg_xyz' for reward function"):
        resolve_reward("no_such_pkg_xyz:f")
    with pytest.raises(ConfigError, match="module 'rl_helpers' has no attribute 'missing'"):
        resolve_reward("rl_helpers:missing")
    with pytest.raises(ConfigError, match="expected 'module:attr'"):
        resolve_reward("rl_helpers:")


def test_weighted_sum_of_sync_and_async_functions() -> None:
    async def async_len(prompts, completions, **fields):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    def only_named(prompts, completions, answer):  # no **kwargs: gets only the fields it names
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    fns = [("correct", arithmetic_correct, 1.0), ("len", async_len, -0.1), ("exact", only_named, 2.0)]
    rewards, components, failures = score(fns, fields={**FIELDS, "extra": [1, 2, 3]})
    assert failures == [None, None, None]
    assert components[1] == {"correct": 0.0, "len": 12.0, "exact": 0.0}
    assert rewards == pytest.approx([1.0 - 0.2 + 2.0, -1.2, 1.0 - 0.1 + 2.0])


def test_abstaining_functions() -> None:
    def abstain_on_wrong(prompts, completions, answer, **_):
        return [1.0 if c == a else None for c, a in zip(completions, answer, strict=True)]

    def never(prompts, completions, **_):
        return [None] * len(completions)

    rewards, components, failures = score([("a", abstain_on_wrong, 1.0), ("b", never, 5.0)])
    assert rewards == [1.0, None, 1.0]  # sample 1: every function abstained -> no reward
    assert failures == [None, None, None]
    assert components[1] == {"a": None, "b": None}
    rewards, _, _ = score([("a", abstain_on_wrong, 1.0), ("c", format_answer_only, 0.5)])
    assert rewards == [1.5, 0.0, 1.5]  # the abstained component is skipped, not counted as 0


def test_failures_are_data_and_mark_the_whole_batch_of_that_function() -> None:
    def boom(prompts, completions, **_):
        raise ValueError("scorer crashed")

    async def hangs(prompts, completions, **_):
        await asyncio.sleep(60)

    release = threading.Event()

    def hangs_in_a_thread(prompts, completions, **_):
        release.wait(30)
        return [0.0] * len(completions)

    def short(prompts, completions, **_):
        return [1.0]

    def words(prompts, completions, **_):
        return ["good"] * len(completions)

    def nan(prompts, completions, **_):
        return [float("nan")] * len(completions)

    try:
        started = time.perf_counter()
        rewards, components, failures = score(
            [
                ("ok", arithmetic_correct, 1.0),
                ("boom", boom, 1.0),
                ("hangs", hangs, 1.0),
                ("thread", hangs_in_a_thread, 1.0),
                ("short", short, 1.0),
                ("words", words, 1.0),
                ("nan", nan, 1.0),
            ],
            timeout_s=0.2,
        )
        assert time.perf_counter() - started < 3  # concurrent, each with its own timeout
    finally:
        release.set()
    assert rewards == [None, None, None]
    assert components[0]["ok"] == 1.0 and components[0]["boom"] is None
    reasons = failures[0].split("; ")
    assert reasons == [
        "reward fn boom raised ValueError: scorer crashed",
        "reward fn hangs timed out after 0.2s",
        "reward fn thread timed out after 0.2s",
        "bad answer from reward fn short: expected 3 values (one per completion), got 1",
        "bad answer from reward fn words: value 0 is str, not a number or None",
        "bad answer from reward fn nan: value 0 is nan, not finite",
    ]
    assert failures[0] == failures[1] == failures[2]


def test_not_a_list_and_array_answers() -> None:
    import numpy as np

    def scalar(prompts, completions, **_):
        return 1.0

    def array(prompts, completions, **_):
        return np.ones(len(completions))

    rewards, _, failures = score([("scalar", scalar, 1.0)])
    assert rewards == [None] * 3
    assert failures[0] == "bad answer from reward fn scalar: expected a list of 3 floats or None, got float"
    rewards, _, failures = score([("array", array, 1.0)])
    assert rewards == [1.0] * 3 and failures == [None] * 3
