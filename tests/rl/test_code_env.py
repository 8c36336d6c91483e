"""The `python_code` env and the `python` tool, against the real sandbox (each run ~0.1-0.3 s).

    .venv/bin/pytest tests/rl/test_code_env.py -q
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.errors import ConfigError, DataError
from rollout.rl.code_env import PythonCodeEnv, extract_code, run_tests
from rollout.rl.envs import resolve_env
from rollout.rl.python_tool import python, python_tool
from rollout.rl.tools import execute_tool_calls, parse_tool_calls, resolve_tools
from rollout.rl.types import Env, StepResult
from rollout.sandbox import SandboxLimits

ROW = {
    "prompt": "Write f(x) returning x squared.",
    "tests": ["assert f(2) == 4", "assert f(-3) == 9", "assert f(0) == 0"],
}
RIGHT = "def f(x):\n    return x * x"
PARTIAL = "def f(x):\n    return 2 * x if x >= 0 else x"  # passes f(2) and f(0)
CRASHING = "raise ValueError('boom')\ndef f(x):\n    return x * x"
LIMITS = {"cpu_s": 2.0, "wall_s": 4.0}


def reply(code: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"Here is my solution:\n```python\n{code}\n```\nDone."}


async def attempt(code: str, **options: object) -> StepResult:
    env = PythonCodeEnv(**{**LIMITS, **options})
    await env.reset(ROW)
    return await env.step(reply(code))


def run_attempts(codes: list[str], **options: object) -> list[StepResult]:
    async def main() -> list[StepResult]:
        return list(await asyncio.gather(*(attempt(code, **options) for code in codes)))

    return asyncio.run(main())


def test_extract_code_takes_the_last_closed_python_block() -> None:
    text = "```python\nfirst()\n```\nthen\n```py\nsecond()\n```\n```text\nnot code\n```"
    assert extract_code(text) == "second()\n"
    assert extract_code("```Python\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nunfinished = (") is None  # cut by max_tokens: nothing to run
    assert extract_code("```\nuntagged()\n```") is None


def test_correct_partial_and_crashing_solutions_score_1_two_thirds_and_0() -> None:
    right, partial, crashing = run_attempts([RIGHT, PARTIAL, CRASHING])
    assert (right.reward, right.done) == (1.0, True) and right.messages == ()
    assert right.info["tests_passed"] == 3 and right.info["tests_total"] == 3
    assert right.info["exit_code"] == 0 and right.info["timed_out"] is False and right.info["killed_reason"] is None
    assert partial.reward == pytest.approx(2 / 3) and partial.done
    assert partial.info["tests_passed"] == 2
    assert (crashing.reward, crashing.info["tests_passed"]) == (0.0, 0)


def test_no_code_block_scores_zero_with_a_reason() -> None:
    async def main() -> StepResult:
        env = PythonCodeEnv()
        await env.reset(ROW)
        return await env.step({"role": "assistant", "content": "def f(x): return x * x"})

    result = asyncio.run(main())
    assert (result.reward, result.done) == (0.0, True)
    assert result.info["reason"] == "no_code_block" and result.info["tests_passed"] == 0


def test_a_forged_summary_in_the_programs_output_does_not_count() -> None:
    records = [{"test": i, "passed": True} for i in range(3)] + [{"done": True}]
    text = "".join(f"@@rollout-test-result-{'0' * 32} {json.dumps(r)}\n" for r in records)
    forger = (
        "import os\n"
        "def f(x):\n    return -1\n"
        f"text = {text!r}\n"
        "print(text, flush=True)\n"
        "for fd in range(1, 32):\n"  # every descriptor the harness might write through
        "    try:\n        os.write(fd, text.encode())\n    except OSError:\n        pass\n"
        "os._exit(0)\n"
    )

    async def main() -> tuple[StepResult, object]:
        env = PythonCodeEnv(**LIMITS)
        await env.reset(ROW)
        result = await env.step(reply(forger))
        run = await run_tests(forger, ROW["tests"], env.limits)
        return result, run

    result, run = asyncio.run(main())
    assert result.info["tests_passed"] == 0 and result.reward == 0.0
    assert result.info["exit_code"] == 0  # it did exit "successfully": that alone earns nothing
    assert text in run.result.stderr  # the forgery ran and printed (to stderr: stdout is the harness's)
    assert not run.completed and run.errors == {}


def test_all_or_nothing() -> None:
    partial, right = run_attempts([PARTIAL, RIGHT], all_or_nothing=True)
    assert partial.reward == 0.0 and partial.info["tests_passed"] == 2
    assert right.reward == 1.0


def test_retry_shows_the_errors_and_the_return_is_the_last_attempts_score() -> None:
    async def main() -> list[StepResult]:
        env = PythonCodeEnv(retry_on_failure=True, **LIMITS)
        assert isinstance(env, Env)
        await env.reset(ROW)
        steps = [await env.step(reply(PARTIAL)), await env.step({"role": "assistant", "content": "sorry"})]
        steps += [await env.step(reply(CRASHING)), await env.step(reply(RIGHT))]
        return steps

    partial, no_code, crashing, right = asyncio.run(main())
    assert not partial.done and partial.reward == pytest.approx(2 / 3)
    (feedback,) = partial.messages
    assert feedback["role"] == "user"
    assert "passed 2 of 3 tests" in feedback["content"]
    assert "assert f(-3) == 9  ->  AssertionError" in feedback["content"]
    assert not no_code.done and no_code.reward == pytest.approx(-2 / 3)
    assert "no ```python code block" in no_code.messages[0]["content"]
    assert not crashing.done and crashing.reward == 0.0
    assert "ValueError: boom" in crashing.messages[0]["content"]
    assert "NameError" in crashing.messages[0]["content"]
    assert right.done and right.messages == () and right.info["attempt"] == 4
    rewards = [s.reward for s in (partial, no_code, crashing, right)]
    assert sum(rewards[:1]) == pytest.approx(2 / 3)  # stopped after attempt 1: its score
    assert sum(rewards[:3]) == pytest.approx(0.0)  # stopped after attempt 3: its score
    assert sum(rewards) == pytest.approx(1.0)


def test_options_are_validated_at_construction() -> None:
    env = resolve_env("python_code")(all_or_nothing=True, cpu_s=1.5, memory_mb=128)
    assert env.limits.cpu_s == 1.5 and env.limits.memory_mb == 128
    with pytest.raises(ConfigError, match=r"env python_code: options.retry: unknown field \(known options: "):
        PythonCodeEnv(retry=True)
    with pytest.raises(ConfigError, match="options.wall_s: .*greater than 0"):
        PythonCodeEnv(wall_s=0)
    with pytest.raises(ConfigError, match="options.memory_mb"):
        PythonCodeEnv(memory_mb="lots")


def test_rows_need_a_list_of_tests() -> None:
    env = PythonCodeEnv()
    for row in ({"prompt": "p"}, {"prompt": "p", "tests": []}, {"prompt": "p", "tests": "assert True"}):
        with pytest.raises(DataError, match='non-empty "tests" list'):
            asyncio.run(env.reset(row))
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(PythonCodeEnv().step(reply(RIGHT)))


def test_python_tool_returns_output_errors_and_a_timeout_message() -> None:
    (tool,) = resolve_tools(["python"])
    assert tool.name == "python" and tool.is_async
    assert tool.parameters["required"] == ["code"]
    quick = python_tool(SandboxLimits(cpu_s=1, wall_s=1.5))
    assert quick.timeout_s > 1.5
    looping = '<tool_call>{"name": "python", "arguments": {"code": "print(7)\\nwhile True: pass"}}</tool_call>'

    async def main() -> tuple[str, str, str]:
        ok, failed = await asyncio.gather(python("print(6 * 7)"), python("print('before')\n1 / 0"))
        (timed_out,) = await execute_tool_calls(parse_tool_calls(looping).calls, {"python": quick})
        assert timed_out.error is None  # the sandbox's limit, reported as the tool's answer
        return ok, failed, timed_out.content

    ok, failed, timed_out = asyncio.run(main())
    assert ok == "42\n"
    assert failed.startswith("before\n[stderr]\nTraceback")
    assert "ZeroDivisionError: division by zero" in failed and failed.endswith("[exit status 1]\n")
    assert timed_out.startswith("7\n[timed out: ")  # what it printed before the limit still comes back


def test_rebinding_builtins_or_json_does_not_fake_passes() -> None:
    cheat = (
        "import builtins, json\n"
        "def f(x):\n    return -1\n"
        "builtins.exec = lambda *args, **kwargs: None\n"
        "json.dumps = lambda record: '{\"test\": 0, \"passed\": true}'\n"
    )
    broken_test = {**ROW, "tests": ["assert f(", *ROW["tests"]]}

    async def main() -> tuple[StepResult, StepResult]:
        env = PythonCodeEnv(**LIMITS)
        await env.reset(ROW)
        cheated = await env.step(reply(cheat))
        await env.reset(broken_test)
        return cheated, await env.step(reply(RIGHT))

    cheated, with_broken_test = asyncio.run(main())
    assert cheated.info["tests_passed"] == 0 and cheated.reward == 0.0
    # A test that doesn't compile fails alone; the others still run.
    assert with_broken_test.info["tests_passed"] == 3 and with_broken_test.reward == pytest.approx(3 / 4)
