"""The `python_code` env (SPEC section 9): write a function, scored by running tests in the sandbox.

    env = PythonCodeEnv(retry_on_failure=True)       # [algorithm.grpo.env] options, as keyword arguments
    messages = await env.reset({"prompt": "Write f(x) returning x squared.",
                                "tests": ["assert f(2) == 4", "assert f(-3) == 9"]})
    step = await env.step({"role": "assistant", "content": "```python\\ndef f(x):\\n    return x * x\\n```"})
    # step.reward == 1.0, step.done, step.info["tests_passed"] == 2

Rows are `{"prompt": ..., "tests": ["assert f(2) == 4", ...]}`: each test is a
Python snippet that passes when it runs without raising. The env takes the
last ```python (or ```py) fenced block of the assistant's message and runs it,
then every test in turn, in one sandboxed program (`rollout.sandbox`); a
test that raises, or that the sandbox never reached (a timeout, a crash),
failed. The score is the fraction of tests passed, or 0/1 with
`all_or_nothing = true`. A message without a closed code block scores 0
(info reason "no_code_block").

Multi-turn (`retry_on_failure = true`): while the score is below 1 the env
answers with a user message (which tests failed, the program's output,
clipped to `feedback_chars`) and the model tries again, until all tests pass
or the episode's `max_turns` ends it. The episode's reward is the *last*
attempt's score: each step's reward is its score minus the previous
attempt's, so the turn rewards (which the episode loop sums) add up to the
last score wherever the episode stops, truncation included. A turn reward
can therefore be negative (an attempt worse than the one before).

How the result can't be forged: a harness (`_HARNESS`, fixed code) runs the
solution with `__name__ == "solution"` (so an `if __name__ == "__main__":`
demo does not run), then each test, and reports each test as a line
`<marker> {json}` on its own copy of stdout; the marker holds a random nonce
drawn per run and handed over on stdin, never written to a file. Everything
the solution prints goes to stderr, and the tests file is deleted before the
solution runs; the harness holds its own references to `exec` and
`json.dumps`. So printing a fake summary, exiting early (`sys.exit`,
`os._exit`), rebinding builtins or reading the tests gains nothing. Not
defended: code that deliberately inspects the harness's frames (the nonce is
in its memory) or returns objects whose `__eq__` is always true; write tests
that check types (`assert type(f(2)) is int and f(2) == 4`) where that
matters.

info: tests_passed, tests_total, timed_out, exit_code, killed_reason (the
sandbox's exit status), attempt (1-based) and reason when there was nothing
to run. Sandbox limits come from the options (validated with the other
options at construction: an unknown or bad option is a `ConfigError`). Keep
`wall_s` under the episode's `step_timeout_s`. This module doesn't import
`rl.envs`, so the env registry there can import it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from rollout.config_base import StrictModel, format_validation_errors
from rollout.errors import ConfigError, DataError
from rollout.inference.types import Message
from rollout.rl.python_tool import clip, exit_notes
from rollout.rl.types import StepResult
from rollout.sandbox import ExecResult, SandboxLimits, run_python

ENV_NAME = "python_code"
_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MARKER_PREFIX = "@@rollout-test-result-"

_HARNESS = """\
import json, os, sys, traceback


def _main():
    marker = sys.stdin.readline().strip()  # a per-run nonce: in no file the solution can read
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    os.remove("tests.json")
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the harness's own channel
    os.dup2(2, 1)  # whatever the solution prints goes to stderr
    sys.stdout = sys.stderr
    # Local references: the solution may rebind builtins.exec or json.dumps, not these.
    run, build, dumps, write, flush = exec, compile, json.dumps, out.write, out.flush

    def emit(record):
        write(marker + " " + dumps(record) + "\\n")
        flush()

    def describe(err):
        try:
            text = type(err).__name__ + (": " + str(err) if str(err) else "")
        except BaseException:
            text = "an exception that cannot be printed"
        return text[:300]

    namespace = {"__name__": "solution", "__file__": "solution.py"}
    try:
        run(build(source, "solution.py", "exec"), namespace)
    except BaseException as err:
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        emit({"load_error": describe(err)})
    for i, test in enumerate(tests):
        try:
            run(build(test, "<test %d>" % (i + 1), "exec"), namespace)
        except BaseException as err:
            emit({"test": i, "passed": False, "error": describe(err)})
        else:
            emit({"test": i, "passed": True})
    emit({"done": True})


_main()
"""
"""Runs `solution.py`, then each test of `tests.json`; reports on the real stdout behind the nonce marker."""


class PythonCodeEnvOptions(StrictModel):
    """The `options` table of a `python_code` env."""

    all_or_nothing: bool = Field(False, description="Score 1 only when every test passes (else the fraction passed).")
    retry_on_failure: bool = Field(
        False, description="On failure, show the errors and let the model try again (up to the episode's max_turns)."
    )
    cpu_s: float = Field(5.0, gt=0, le=600, description="Sandbox CPU seconds per attempt.")
    wall_s: float = Field(10.0, gt=0, le=600, description="Sandbox wall-clock seconds per attempt.")
    memory_mb: int = Field(256, ge=32, le=65536, description="Sandbox address space, MiB.")
    max_output_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024, description="Per stream.")
    max_processes: int = Field(32, ge=1, le=4096, description="Processes and threads of the program.")
    feedback_chars: int = Field(2000, ge=100, le=100_000, description="Most characters of a retry message.")

    def sandbox_limits(self) -> SandboxLimits:
        return SandboxLimits(
            cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes, max_processes=self.max_processes,
        )


@dataclass(frozen=True)
class TestRun:
    """How one attempt went: per-test outcomes from the harness plus the sandbox's verdict."""

    passed: tuple[bool, ...]
    errors: dict[int, str]
    """Test index -> "ExceptionType: message" for the tests that raised."""
    load_error: str | None
    completed: bool
    """The harness reported every test (no timeout or crash cut it short)."""
    result: ExecResult

    @property
    def num_passed(self) -> int:
        return sum(self.passed)


def extract_code(text: str) -> str | None:
    """The last closed ```python / ```py fenced block of `text`, or None."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


async def run_tests(code: str, tests: list[str], limits: SandboxLimits) -> TestRun:
    """Run `code` then each test in one sandboxed program; only lines behind this run's nonce count."""
    marker = _MARKER_PREFIX + secrets.token_hex(16)
    result = await run_python(
        _HARNESS, limits=limits, stdin=marker + "\n",
        files={"solution.py": code, "tests.json": json.dumps(tests)},
    )
    passed = [False] * len(tests)
    seen: set[int] = set()
    errors: dict[int, str] = {}
    load_error: str | None = None
    completed = False
    for line in result.stdout.splitlines():
        if not line.startswith(marker + " "):
            continue
        try:
            record = json.loads(line[len(marker) + 1 :])
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        index = record.get("test")
        if isinstance(index, int) and 0 <= index < len(tests) and index not in seen:
            seen.add(index)
            passed[index] = record.get("passed") is True
            if not passed[index]:
                errors[index] = str(record.get("error", ""))
        elif "load_error" in record:
            load_error = str(record["load_error"])
        elif record.get("done") is True:
            completed = len(seen) == len(tests)
    return TestRun(tuple(passed), errors, load_error, completed, result)


class PythonCodeEnv:
    """One coding episode: one attempt, or attempts until the tests pass (`retry_on_failure`)."""

    def __init__(self, **options: Any) -> None:
        try:
            self.options = PythonCodeEnvOptions.model_validate(options)
        except ValidationError as err:
            raise options_error(ENV_NAME, err, options, PythonCodeEnvOptions) from None
        self.limits = self.options.sandbox_limits()
        self._tests: list[str] | None = None
        self._attempt = 0
        self._last_score = 0.0

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        tests = row.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise DataError(f'the {ENV_NAME} env needs a non-empty "tests" list of strings in every prompt row')
        self._tests = list(tests)
        self._attempt = 0
        self._last_score = 0.0
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    async def step(self, assistant_message: Message) -> StepResult:
        if self._tests is None:
            raise RuntimeError("PythonCodeEnv.step called before reset")
        self._attempt += 1
        code = extract_code(assistant_message.get("content") or "")
        total = len(self._tests)
        if code is None:
            info: dict[str, Any] = {
                "tests_passed": 0, "tests_total": total, "timed_out": False, "exit_code": None,
                "killed_reason": None, "attempt": self._attempt, "reason": "no_code_block",
            }
            feedback = "Your reply has no ```python code block. Reply with the complete solution in one."
            return self._finish(0.0, feedback, info)
        run = await run_tests(code, self._tests, self.limits)
        info = {
            "tests_passed": run.num_passed, "tests_total": total, "timed_out": run.result.timed_out,
            "exit_code": run.result.exit_code, "killed_reason": run.result.killed_reason,
            "attempt": self._attempt,
        }
        if self.options.all_or_nothing:
            score = 1.0 if run.num_passed == total else 0.0
        else:
            score = run.num_passed / total
        return self._finish(score, self._feedback(run), info)

    def _finish(self, score: float, feedback: str, info: dict[str, Any]) -> StepResult:
        """This attempt's step: its reward is the change in score, so the turn rewards sum to the last score."""
        reward = score - self._last_score
        self._last_score = score
        info["score"] = score
        if score >= 1.0 or not self.options.retry_on_failure:
            return StepResult((), reward, True, info)
        message = {"role": "user", "content": clip(feedback, self.options.feedback_chars)}
        return StepResult((message,), reward, False, info)

    def _feedback(self, run: TestRun) -> str:
        """What the model reads after a failed attempt: failed tests, the output, how it ended."""
        assert self._tests is not None
        lines = [f"Your code passed {run.num_passed} of {len(self._tests)} tests."]
        failed = [i for i, ok in enumerate(run.passed) if not ok]
        if failed:
            lines.append("Failed:")
            for i in failed[:10]:
                why = run.errors.get(i, "not run (the program stopped before this test)")
                lines.append(f"- {self._tests[i].strip()[:200]}  ->  {why}")
            if len(failed) > 10:
                lines.append(f"- ... and {len(failed) - 10} more")
        output = run.result.stderr.strip()
        if output:
            lines += ["Output:", clip(output, max(self.options.feedback_chars // 2, 100))]
        lines += [f"[{note}]" for note in exit_notes(run.result, self.limits)]
        lines.append("Fix the code and reply with the complete solution in a ```python block.")
        return "\n".join(lines)


def options_error(
    env_name: str, err: ValidationError, options: Mapping[str, Any], model: type[StrictModel]
) -> ConfigError:
    """One `ConfigError` for an env's bad options: `env NAME: options.KEY: problem (options: a, b, ...)`."""
    problems = [f"env {env_name}: options.{p}" for p in format_validation_errors(err, options)]
    known = ", ".join(model.model_fields)
    return ConfigError(f"{problems[0]} (known options: {known})", details=problems[1:])
