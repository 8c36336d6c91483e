"""The built-in `python` tool: run model-written code in the sandbox and say plainly how it went.

    await python("print(sum(range(10)))")                       # "45\\n"
    await python("1/0")                                         # "...ZeroDivisionError...\\n[exit status 1]"
    await python("while True: pass")                            # "[timed out: ...]"
    tool = python_tool(SandboxLimits(cpu_s=2, wall_s=4))        # other limits, as a `Tool`

The program runs in `rollout.sandbox` (its own process, directory, uid and
namespaces where the host allows; see that package's docstring). What comes
back is one string for the model: stdout, then stderr under a `[stderr]`
line, then one bracketed line per thing worth knowing (a nonzero exit
status, a timeout, a limit that killed it, output that was cut). Each stream
is clipped (head and tail kept: a traceback's last line is the useful one)
so the whole answer fits the tool machinery's result cap. The code runs as
`__main__` from `program.py` under a small runner that line-buffers stdout
(what it printed before a timeout still comes back) and drops its own frame
from tracebacks. A tool never raises at the model: only a sandbox that
cannot run at all raises (`SandboxError`), which the tool machinery reports
as "tool_raised".

The default wall clock is 8 s, not 10: `resolve_tools` gives built-in tools
the default 10 s tool timeout, and the sandbox's own limit should fire first
so the model reads "[timed out ...]" rather than a bare timeout error.
`python_tool(limits)` sets the tool timeout above the wall clock itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.sandbox import ExecResult, SandboxLimits, run_python

if TYPE_CHECKING:  # rl/tools.py imports this module to list the tool as a built-in
    from rollout.rl.tools import Tool

DEFAULT_LIMITS = SandboxLimits(cpu_s=5.0, wall_s=8.0, memory_mb=256, max_output_bytes=16 * 1024)
MAX_CHARS = 1800
"""Of stdout and stderr together (half each), so that with the notes the answer stays under
`execute_tool_calls`' default cap of 2000 characters, which cuts the tail."""
_TOOL_TIMEOUT_MARGIN_S = 5.0
"""Sandbox set-up and clean-up on top of the program's wall clock."""
PROGRAM_FILE = "program.py"
_RUNNER = f"""\
import sys, traceback
sys.stdout.reconfigure(line_buffering=True)  # what it printed before a timeout still comes back
sys.argv = [{PROGRAM_FILE!r}]
with open({PROGRAM_FILE!r}, encoding="utf-8") as f:
    source = f.read()
try:
    exec(compile(source, {PROGRAM_FILE!r}, "exec"), {{"__name__": "__main__", "__file__": {PROGRAM_FILE!r}}})
except SystemExit:
    raise
except BaseException as err:
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # the program's frames only
    sys.exit(1)
"""
"""Runs the model's code from `program.py` as `__main__`, stdout line-buffered."""


async def python(code: str) -> str:
    """Run a Python 3 program in a sandbox (no network, no files kept, 5 s CPU, 256 MiB) and return its output.

    Args:
        code: The complete program. Print what you want to see: only stdout and stderr come back.
    """
    return await run_program(code, DEFAULT_LIMITS, max_chars=MAX_CHARS)


async def run_program(code: str, limits: SandboxLimits, *, max_chars: int) -> str:
    """Run `code` as the `python` tool does and describe how it went."""
    result = await run_python(_RUNNER, limits=limits, files={PROGRAM_FILE: code})
    return describe_exec_result(result, limits, max_chars=max_chars)


def python_tool(limits: SandboxLimits = DEFAULT_LIMITS, *, max_chars: int = MAX_CHARS) -> Tool:
    """The `python` tool with other sandbox limits (its tool timeout follows the wall clock)."""
    from rollout.rl.tools import tool_from_function

    async def run(code: str) -> str:
        return await run_program(code, limits, max_chars=max_chars)

    network = "network allowed" if limits.network else "no network"
    run.__doc__ = (python.__doc__ or "").replace(
        "(no network, no files kept, 5 s CPU, 256 MiB)",
        f"({network}, no files kept, {limits.cpu_s:g} s CPU, {limits.memory_mb} MiB)",
    )
    return tool_from_function(run, name="python", timeout_s=limits.wall_s + _TOOL_TIMEOUT_MARGIN_S)


def describe_exec_result(result: ExecResult, limits: SandboxLimits, *, max_chars: int = MAX_CHARS) -> str:
    """stdout, `[stderr]` + stderr, and bracketed notes on how the program ended ("(no output)" if nothing)."""
    parts: list[str] = []
    if result.stdout:
        parts.append(clip(result.stdout, max_chars // 2))
    if result.stderr:
        parts.append("[stderr]\n" + clip(result.stderr, max_chars // 2))
    notes = exit_notes(result, limits)
    if not parts and not notes:
        return "(no output)"
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    return text + "".join(f"[{note}]\n" for note in notes)


def exit_notes(result: ExecResult, limits: SandboxLimits) -> list[str]:
    """How the program ended, in words, when it did not simply exit 0 with all its output."""
    notes: list[str] = []
    reason = result.killed_reason
    if reason == "wall_timeout":
        notes.append(f"timed out: the program ran past its {limits.wall_s:g} s wall-clock limit and was killed")
    elif reason == "cpu_limit":
        notes.append(f"timed out: the program used its {limits.cpu_s:g} s of CPU time and was killed")
    elif reason == "memory":
        notes.append(f"killed: out of memory (limit {limits.memory_mb} MiB)")
    elif reason == "file_size":
        notes.append(f"killed: wrote a file larger than {limits.max_file_size_mb} MiB")
    elif reason == "output_limit":
        notes.append(f"killed: printed more than {limits.max_output_bytes} bytes")
    elif reason is not None:
        notes.append(f"killed: {reason}")
    if result.exit_code not in (None, 0):
        notes.append(f"exit status {result.exit_code}")
    elif result.signal is not None and reason is None:
        notes.append(f"killed by signal {result.signal}")
    if (result.stdout_truncated or result.stderr_truncated) and reason != "output_limit":
        notes.append("output truncated")
    return notes


def clip(text: str, max_chars: int) -> str:
    """`text` if it fits, else its head and tail around a "[... N characters cut ...]" line."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars - 40, 0)
    head, tail = keep // 3, keep - keep // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail:]}"
