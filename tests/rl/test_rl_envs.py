"""Built-in envs, math answer extraction / normalisation, env resolution and envs as rewards."""

from __future__ import annotations

import asyncio

import pytest

from rollout.errors import ConfigError
from rollout.rl.builtins import BUILTIN_ENVS
from rollout.rl.calculator_env import CalculatorEnv
from rollout.rl.envs import ArithmeticEnv, MathAnswerEnv, resolve_env, reward_from_env
from rollout.rl.math_answer import extract_math_answer, math_answers_match, normalize_math_answer
from rollout.rl.rewards import score_batch
from rollout.rl.types import Env

ROW = {"prompt": [{"role": "user", "content": "What is 3+8?"}], "answer": "11"}


def play(env: Env, row: dict, completion: str):
    async def episode():
        messages = await env.reset(row)
        return messages, await env.step({"role": "assistant", "content": completion})

    return asyncio.run(episode())


def test_arithmetic_env_rewards_the_right_first_integer() -> None:
    messages, result = play(ArithmeticEnv(), ROW, "11")
    assert messages == ROW["prompt"]
    assert (result.reward, result.done, result.messages) == (1.0, True, ())
    assert play(ArithmeticEnv(), ROW, " 011 is it")[1].reward == 1.0
    assert play(ArithmeticEnv(), ROW, "12")[1].reward == 0.0
    assert play(ArithmeticEnv(), ROW, "eleven")[1].reward == 0.0
    text_prompt = {"prompt": "What is 3+8?", "answer": "11"}
    assert play(ArithmeticEnv(), text_prompt, "11")[0] == [{"role": "user", "content": "What is 3+8?"}]
    with pytest.raises(ConfigError, match='needs an "answer" field'):
        play(ArithmeticEnv(), {"prompt": "hi"}, "11")


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("So the result is \\boxed{\\frac{1}{2}}.", "0.5"),
        ("\\boxed{\\dfrac{1}{2}}", "1/2"),
        ("\\boxed{0.50}", "\\frac{2}{4}"),
        ("The answer is 1,234.", "1234"),
        ("The answer is 1,234,567", "1234567"),
        ("answer: -7", "-7"),
        ("x = \\boxed{-\\frac{3}{4}}", "-0.75"),
        ("Final Answer: \u22125", "-5"),
        ("She has 3 apples, then 5 more: 8", "8"),
        ("#### 42", "42"),
        ("The answer is 3.0", "3"),
        ("It went up 50%.", "50"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{90^\\circ}", "90"),
        ("The answer is $12.", "12"),
        ("\\boxed{12 \\text{ dollars}}", "12"),
        ("The answer is 12 apples.", "12"),
        ("\\boxed{x = 4}", "4"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\dfrac{\\sqrt{2}}{2}"),
        ("\\boxed{{5}}", "5"),
        ("first \\boxed{3}, corrected: \\boxed{4}", "4"),
        ("Natalia sold 48/2 = 24 clips in May, 72 in all.", "Natalia ... #### 72"),
    ],
)
def test_math_answers_that_match(completion: str, answer: str) -> None:
    assert math_answers_match(completion, answer), (extract_math_answer(completion), answer)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("I don't know.", "5"),
        ("", "5"),
        ("\\boxed{-5}", "5"),
        ("\\boxed{\\frac{1}{3}}", "0.33"),
        ("The answer is 12", "1,234"),
        ("\\boxed{x+1}", "x-1"),
    ],
)
def test_math_answers_that_do_not_match(completion: str, answer: str) -> None:
    assert not math_answers_match(completion, answer)


def test_math_extraction_edge_cases() -> None:
    assert extract_math_answer("no answer here") is None
    assert extract_math_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_math_answer("\\boxed{1") == "1"  # unclosed box: fall back to the last number
    assert extract_math_answer("it is -3 or -4") == "-4"
    assert normalize_math_answer("\\frac12") == "1/2"
    assert normalize_math_answer("2/4") == normalize_math_answer("0.5") == "1/2"
    assert normalize_math_answer("1,000") == "1000"
    assert normalize_math_answer("(1, 2)") == "(1,2)"  # a tuple's comma is not a thousands separator
    assert normalize_math_answer("Yes") == "yes"


def test_math_env() -> None:
    row = {"prompt": "Half of one?", "answer": "0.5"}
    _, result = play(MathAnswerEnv(), row, "That is \\boxed{\\frac{1}{2}}")
    assert (result.reward, result.done, result.info["extracted"]) == (1.0, True, "\\frac{1}{2}")
    assert play(MathAnswerEnv(), row, "1/3")[1].reward == 0.0


def test_resolve_env() -> None:
    assert resolve_env("arithmetic") is ArithmeticEnv
    assert resolve_env("math") is MathAnswerEnv
    assert resolve_env("calculator") is CalculatorEnv
    assert set(BUILTIN_ENVS) == {"arithmetic", "math", "calculator", "python_code", "guess_number"}
    two_turn = resolve_env("rl_helpers:TwoTurnEnv")
    assert isinstance(two_turn(), Env)
    with pytest.raises(
        ConfigError, match=r"unknown env 'chess': expected a built-in env \(arithmetic, calculator, guess_number, math, python_code\)"
    ):
        resolve_env("chess")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz' for env"):
        resolve_env("no_such_module_xyz:Env")
    with pytest.raises(ConfigError, match="module 'rl_helpers' has no attribute 'Nope'"):
        resolve_env("rl_helpers:Nope")
    with pytest.raises(ConfigError, match="is not callable"):
        resolve_env("rl_helpers:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="RuntimeError: this plugin is broken"):
        resolve_env("rl_broken_plugin:Env")


def test_envs_as_reward_functions() -> None:
    fns = [
        ("arith", reward_from_env(ArithmeticEnv, name="arithmetic"), 1.0),
        ("math", reward_from_env(MathAnswerEnv, name="math"), 1.0),
    ]
    rewards, components, failures = asyncio.run(
        score_batch(
            fns, ["What is 3+8?"] * 3, ["11", "12", "\\boxed{11}"], {"answer": ["11"] * 3}, timeout_s=5
        )
    )
    assert components == [
        {"arith": 1.0, "math": 1.0},
        {"arith": 0.0, "math": 0.0},
        {"arith": 1.0, "math": 1.0},
    ]
    assert rewards == [2.0, 0.0, 2.0] and failures == [None] * 3

    multi = [("two", reward_from_env(resolve_env("rl_helpers:TwoTurnEnv"), name="two"), 1.0)]
    rewards, _, failures = asyncio.run(score_batch(multi, ["q"], ["a"], {}, timeout_s=5))
    assert rewards == [None]
    assert "env 'two' is multi-turn" in failures[0]
