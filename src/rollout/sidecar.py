"""Sidecars (SPEC section 11): reward functions, envs and tools served by any executable that
speaks JSON-RPC 2.0 over stdio, one JSON message per line.

    sidecar = Sidecar(["node", "reward.js"], timeout_s=10, max_restarts=3)
    reward_fn = SidecarReward(sidecar)                   # a batched async reward function
    values = await reward_fn(prompts, completions, answer=answers)
    env = SidecarEnvFactory(sidecar)()                   # an `Env`; many episodes share one process
    await close_sidecars()                               # at the end of a run: no process outlives it

The protocol (docs/sidecar-protocol.md has every shape): rollout writes requests
`{"jsonrpc": "2.0", "id": 7, "method": "reward.score", "params": {...}}` to the sidecar's
stdin, one per line; the sidecar answers each on stdout with `{"jsonrpc": "2.0", "id": 7,
"result": ...}` or `{..., "error": {"code": -32000, "message": "..."}}`, in any order.
Methods: `describe` (first, after every start: `{"name", "kinds": ["reward" | "env" |
"tool"], "tools": [...]}`), `reward.score` (batched), `env.reset` / `env.step` (with an
`episode_id`, so one process serves many concurrent episodes), `tool.call`. Logs go to
stderr, which is kept (the last lines) for error messages.

Failures are data, never the run's end. Every call has a timeout (`describe` after a start
at least `START_TIMEOUT_S`, for sidecars that load a model first). A crash (the process
exits), a hang (a call times out), a line that is not a JSON-RPC response, or an answer to
an id nobody asked: the process group is killed, every call in flight fails with one
`SidecarError` naming the sidecar (with its stderr tail), and the next call starts a fresh
process — up to `max_restarts` restarts in a row (a good answer resets the count), after
which the sidecar is given up and every call fails at once. An error object fails that call
only. The callers turn a `SidecarError` into dropped samples (`score_batch`) or an ended
episode (`rl/episode.py`), counted like any failing reward function or env.

A process belongs to the event loop that started it; a call from another loop starts a new
one. `close_sidecars()` stops those of the running loop (`BatchSource.close` calls it; the
end of `asyncio.run` does too, through an async-generator guard), and a finalizer kills the
process group of any left when its `Sidecar` is collected or the interpreter exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import math
import os
import shlex
import signal
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.errors import RolloutError
from rollout.inference.types import Message, Prompt
from rollout.rl.types import RewardValues, StepResult
from rollout.sidecar_config import SidecarConfig

MAX_LINE_BYTES = 16 * 2**20
"""The longest line a sidecar may write (a whole batch of rewards is one line)."""
STDERR_LINES = 20
START_TIMEOUT_S = 30.0
"""The least time the `describe` after a start gets (importing a model, compiling) whatever `timeout_s`."""
STOP_GRACE_S = 1.0
"""How long a sidecar has to exit after its stdin closes before its process group is killed."""
KINDS = ("reward", "env", "tool")


class SidecarError(RolloutError):
    """A sidecar crashed, hung, wrote something that is not a JSON-RPC response, answered an
    error, or answered the wrong shape. The message names the sidecar's command."""


@dataclass(frozen=True)
class ToolSchema:
    """A tool a sidecar advertises in `describe`: what the chat template renders."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(eq=False)
class _Process:
    """One started process of a sidecar and the calls waiting on it."""

    proc: asyncio.subprocess.Process
    generation: int
    orphan_guard: weakref.finalize
    """Kills the group if the `Sidecar` is collected, or at interpreter exit, while it runs."""
    pending: dict[int, tuple[asyncio.Future[Any], str]] = field(default_factory=dict)
    abandoned: set[int] = field(default_factory=set)
    """Ids of calls cancelled by their caller: a late answer to one is not an error."""
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """Its stdout and stderr readers."""
    drained: asyncio.Task[None] | None = None
    dead: str | None = None
    """Why it was failed or stopped (set once)."""


_LIVE: weakref.WeakSet[Sidecar] = weakref.WeakSet()


class Sidecar:
    """One sidecar command: its process (started on the first call), JSON-RPC calls with ids,
    timeouts, and bounded restarts."""

    def __init__(
        self, command: Sequence[str], *, timeout_s: float = 10.0, max_restarts: int = 3,
        cwd: str | Path | None = None,
    ) -> None:
        if not command:
            raise ValueError("a sidecar needs a command")
        if not (math.isfinite(timeout_s) and timeout_s > 0) or max_restarts < 0:
            raise ValueError("timeout_s must be > 0 and max_restarts >= 0")
        self.command = tuple(command)
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.cwd = None if cwd is None else Path(cwd)
        self.info: dict[str, Any] = {}
        """The current process's `describe` answer."""
        self.restarts = 0
        """Processes started after a failure, over the sidecar's life."""
        self._current: _Process | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._failures_in_row = 0
        self._given_up: str | None = None
        self._unfinished: set[_Process] = set()
        """Killed processes whose pipes are still being drained."""

    @classmethod
    def from_config(cls, cfg: SidecarConfig) -> Sidecar:
        return cls(cfg.command, timeout_s=cfg.timeout_s, max_restarts=cfg.max_restarts, cwd=cfg.cwd)

    def __repr__(self) -> str:
        return f"Sidecar({shlex.join(self.command)!r})"

    @property
    def who(self) -> str:
        """How messages name it: `sidecar "node reward.js"`."""
        return f'sidecar "{shlex.join(self.command)}"'

    @property
    def given_up(self) -> bool:
        return self._given_up is not None

    # --- calls -------------------------------------------------------------------------

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Send one request and return its `result`; a `SidecarError` on any failure."""
        result, _ = await self.call_on(method, params)
        return result

    async def call_on(
        self, method: str, params: Mapping[str, Any], *, generation: int | None = None
    ) -> tuple[Any, int]:
        """`call`, also returning which process answered (its generation); with `generation`,
        fail if the process that served earlier calls was replaced (state kept across calls is gone)."""
        process = await self._running()
        if generation is not None and process.generation != generation:
            raise SidecarError(f"{self.who} was restarted since this episode began: its state there is lost")
        kind = method.partition(".")[0]
        if kind in KINDS and kind not in self.info["kinds"]:
            raise SidecarError(
                f"{self.who} does not serve {method}: its describe lists kinds {self.info['kinds']}"
            )
        return await self._request(process, method, params), process.generation

    def describe_blocking(self) -> dict[str, Any]:
        """Start a separate process just for `describe` and stop it; callable with or without a
        running loop (it runs in a thread). For what must be known at setup: a sidecar's tools."""
        probe = Sidecar(self.command, timeout_s=self.timeout_s, max_restarts=0, cwd=self.cwd)

        async def ask() -> dict[str, Any]:
            try:
                await probe._running()
                return probe.info
            finally:
                await probe.aclose()

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sidecar-describe") as pool:
            return pool.submit(asyncio.run, ask()).result()

    # --- lifecycle ---------------------------------------------------------------------

    async def _running(self) -> _Process:
        """The live process, started (and described) if there is none."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.kill()  # a process of another (finished) loop can't be awaited from this one
            self._loop, self._lock = loop, asyncio.Lock()
        assert self._lock is not None
        async with self._lock:
            current = self._current
            if current is not None and current.dead is None:
                return current
            if self._given_up is not None:
                raise SidecarError(self._given_up)
            if current is not None:
                self.restarts += 1
            process = await self._spawn()
            try:
                info = await self._request(process, "describe", {}, timeout_s=max(self.timeout_s, START_TIMEOUT_S))
            except asyncio.CancelledError:  # our caller stopped waiting: not the sidecar's failure
                self._current = None
                self._kill(process)
                raise
            problem = _describe_problem(info)
            if problem is not None:
                raise self._fail(process, f"bad describe answer: {problem}", permanent=True)
            self.info = info
            return process

    async def _spawn(self) -> _Process:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=self.cwd, start_new_session=True, limit=MAX_LINE_BYTES,
            )
        except OSError as err:  # not found, not executable: retrying won't help
            self._given_up = f"{self.who}: cannot start it: {err}"
            raise SidecarError(self._given_up) from None
        process = _Process(proc, next(self._generations), weakref.finalize(self, _kill_group, proc.pid))
        await _stop_with_the_loop(asyncio.get_running_loop())
        process.tasks = [
            asyncio.create_task(self._read_stdout(process), name=f"{self.who} stdout"),
            asyncio.create_task(self._read_stderr(process), name=f"{self.who} stderr"),
        ]
        self._current = process
        _LIVE.add(self)
        return process

    async def aclose(self) -> None:
        """Stop the process: close its stdin, give it `STOP_GRACE_S` to exit, then kill its group
        and drain its pipes. A later call starts a fresh one (not counted as a restart)."""
        process, self._current = self._current, None
        if self._loop is not asyncio.get_running_loop():
            if process is not None:
                self.kill_process(process)
            return
        if process is not None and process.dead is None:
            process.dead = f"{self.who} was stopped"
            for future, _ in process.pending.values():
                if not future.done():
                    future.set_exception(SidecarError(process.dead))
            with contextlib.suppress(OSError, RuntimeError):  # already gone
                assert process.proc.stdin is not None
                process.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.proc.wait(), STOP_GRACE_S)
            self._kill(process)
        for dead in list(self._unfinished):  # `asyncio.run` may have cancelled a drain at its end
            self._drain_later(dead)
        await asyncio.gather(*(p.drained for p in list(self._unfinished) if p.drained), return_exceptions=True)
        _LIVE.discard(self)

    def kill(self) -> None:
        """Kill the process group now, from any thread or loop (a new loop, a test's cleanup)."""
        process, self._current = self._current, None
        if process is not None:
            self.kill_process(process)
        self._unfinished.clear()

    def kill_process(self, process: _Process) -> None:
        process.dead = process.dead or f"{self.who} was killed"
        process.orphan_guard.detach()
        _kill_group(process.proc.pid)

    def _kill(self, process: _Process) -> None:
        """Kill it, then drain its pipes and reap it in this loop (see `_drain`)."""
        self.kill_process(process)
        self._unfinished.add(process)
        self._drain_later(process)

    def _drain_later(self, process: _Process) -> None:
        if process.drained is None or process.drained.cancelled():
            process.drained = asyncio.get_running_loop().create_task(self._drain(process))

    async def _drain(self, process: _Process) -> None:
        """Close a killed process's stdin, stop its readers and read its pipes to the end, so its
        transport closes while the loop still runs (else it warns when collected)."""
        with contextlib.suppress(OSError, RuntimeError):
            assert process.proc.stdin is not None
            process.proc.stdin.close()
        readers = [t for t in process.tasks if t is not asyncio.current_task()]
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        with contextlib.suppress(TimeoutError, OSError, ValueError):
            await asyncio.wait_for(process.proc.communicate(), STOP_GRACE_S)
        self._unfinished.discard(process)

    # --- the wire ----------------------------------------------------------------------

    async def _request(
        self, process: _Process, method: str, params: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        request_id = next(self._ids)
        try:
            line = json.dumps(
                {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params},
                ensure_ascii=False, allow_nan=False,
            )
        except (TypeError, ValueError) as err:  # our side's data, not the sidecar's fault
            raise SidecarError(f"{self.who}: cannot send {method}: the params are not JSON ({err})") from None
        if process.dead is not None:
            raise SidecarError(process.dead)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        process.pending[request_id] = (future, method)
        try:
            stdin = process.proc.stdin
            assert stdin is not None
            try:
                stdin.write(line.encode() + b"\n")
                await stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died: the stdout reader sees the end and fails this call with the reason
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(future)
            except TimeoutError:
                process.pending.pop(request_id, None)
                if future.done():  # answered (or failed) at the deadline
                    return future.result()
                raise self._fail(process, f"timed out after {timeout_s:g}s on {method}") from None
        except asyncio.CancelledError:
            process.abandoned.add(request_id)
            raise
        finally:
            process.pending.pop(request_id, None)

    async def _read_stdout(self, process: _Process) -> None:
        stdout = process.proc.stdout
        assert stdout is not None
        while process.dead is None:
            try:
                line = await stdout.readline()
            except ValueError:  # over the stream's limit
                self._fail(process, f"wrote a line longer than {MAX_LINE_BYTES} bytes")
                return
            if line:
                self._on_line(process, line)
                continue
            if process.dead is not None:  # stopped or failed on purpose
                return
            try:
                code: int | None = await asyncio.wait_for(process.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                code = None
            with contextlib.suppress(TimeoutError):  # its last words on stderr
                await asyncio.wait_for(asyncio.shield(process.tasks[1]), 0.5)
            self._fail(process, _exit_reason(code))
            return

    async def _read_stderr(self, process: _Process) -> None:
        stderr = process.proc.stderr
        assert stderr is not None
        with contextlib.suppress(ValueError):  # a line over the limit ends the capture, not the sidecar
            while line := await stderr.readline():
                text = line.decode("utf-8", errors="replace").rstrip()
                if text:
                    process.stderr.append(text[:500])

    def _on_line(self, process: _Process, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return
        try:
            message = json.loads(text)
        except json.JSONDecodeError:
            self._fail(process, f"wrote a line that is not JSON: {_clip(text)!r} (logs go to stderr)")
            return
        problem = _response_problem(message)
        if problem is not None:
            self._fail(process, f"{problem}: {_clip(text)!r}")
            return
        request_id = message["id"]
        ours = isinstance(request_id, int) and not isinstance(request_id, bool)
        entry = process.pending.pop(request_id, None) if ours else None
        if entry is None:
            if ours and request_id in process.abandoned:
                process.abandoned.discard(request_id)
                return
            if request_id is None and "error" in message:
                self._fail(process, f"reported an error for no request: {_error_text(message['error'])}")
            else:
                self._fail(process, f"answered id {request_id!r}, which matches no pending request")
            return
        future, method = entry
        if method != "describe":  # a well-formed answer to real work: this process works
            self._failures_in_row = 0
        if future.done():
            return
        if "error" in message:
            future.set_exception(SidecarError(f"{self.who}: {method} failed: {_error_text(message['error'])}"))
        else:
            future.set_result(message["result"])

    def _fail(self, process: _Process, reason: str, *, permanent: bool = False) -> SidecarError:
        """Kill a misbehaving process and fail its calls; the next call restarts it, unless that
        was the last restart allowed in a row or a restart can't help (`permanent`)."""
        if process.dead is not None:
            return SidecarError(process.dead)
        tail = f"; stderr: {_clip(' | '.join(process.stderr), 600)}" if process.stderr else ""
        self._failures_in_row += 1
        if permanent:
            what = "; not restarting it (a restart would answer the same)"
        elif self._failures_in_row > self.max_restarts:
            what = f"; given up after {self.max_restarts} restart(s) in a row"
        else:
            what = f"; restarting it ({self._failures_in_row} of {self.max_restarts} restarts in a row)"
        process.dead = f"{self.who}: {reason}{tail}{what}"
        if self._given_up is None and (permanent or self._failures_in_row > self.max_restarts):
            self._given_up = process.dead
        for future, _ in process.pending.values():
            if not future.done():
                future.set_exception(SidecarError(process.dead))
        process.pending.clear()
        self._kill(process)
        return SidecarError(process.dead)


def _kill_group(pid: int) -> None:
    # start_new_session=True made the sidecar a process group leader: this takes its children too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def close_sidecars() -> None:
    """Stop every sidecar process started in the running event loop (the end of a run)."""
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(s.aclose() for s in list(_LIVE) if s._loop is loop))


_LOOP_GUARDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncGenerator[None, None]] = (
    weakref.WeakKeyDictionary()
)


async def _stop_with_the_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Make the loop's end stop its sidecars: an async generator, started and left suspended, is
    closed by `loop.shutdown_asyncgens()`, which `asyncio.run` calls before closing the loop."""
    if loop in _LOOP_GUARDS:
        return

    async def guard() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            await close_sidecars()

    _LOOP_GUARDS[loop] = guard()
    await anext(_LOOP_GUARDS[loop])


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…"


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "closed its stdout"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _response_problem(message: object) -> str | None:
    if not isinstance(message, dict):
        return "wrote JSON that is not a JSON-RPC response object"
    if message.get("jsonrpc") != "2.0":
        return 'wrote a message without "jsonrpc": "2.0"'
    if "id" not in message:
        return "wrote a message without an id (only responses are allowed on stdout)"
    if ("result" in message) == ("error" in message):
        return "wrote a response with both or neither of result and error"
    error = message.get("error")
    if "error" in message and not (
        isinstance(error, dict) and isinstance(error.get("code"), int) and isinstance(error.get("message"), str)
    ):
        return 'wrote an error that is not {"code": int, "message": str}'
    return None


def _error_text(error: Mapping[str, Any]) -> str:
    data = f" ({_clip(json.dumps(error['data'], default=str))})" if error.get("data") is not None else ""
    return f"{_clip(error['message'], 500)} (code {error['code']}){data}"


def _describe_problem(info: object) -> str | None:
    if not isinstance(info, dict):
        return f"expected an object, got {type(info).__name__}"
    kinds = info.get("kinds")
    if not isinstance(kinds, list) or not kinds or any(k not in KINDS for k in kinds):
        return f'"kinds" must be a non-empty list of {", ".join(KINDS)}, got {kinds!r}'
    try:
        tool_schemas(info)
    except ValueError as err:
        return str(err)
    if "tool" in kinds and not info.get("tools"):
        return 'kind "tool" needs a non-empty "tools" list'
    return None


def tool_schemas(info: Mapping[str, Any]) -> list[ToolSchema]:
    """The tools in a `describe` answer: OpenAI entries `{"type": "function", "function": {...}}`
    or bare `{"name", "description", "parameters"}`."""
    tools = info.get("tools", [])
    if not isinstance(tools, list):
        raise ValueError('"tools" must be a list')
    out = []
    for i, entry in enumerate(tools):
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f'tools[{i}] must be an object with a "name"')
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ValueError(f'tools[{i}] ({fn["name"]}): "parameters" must be a {{"type": "object"}} schema')
        out.append(ToolSchema(fn["name"], str(fn.get("description", "")), parameters))
    return out


# --- adapters: a reward function, an env, a tool ---------------------------------------------


class SidecarReward:
    """A batched async reward function: one `reward.score` call per batch.

    params `{"prompts": [...], "completions": [...], "fields": {"answer": [...], ...}}`,
    result `{"rewards": [float | null, ...]}` (null abstains). `score_batch` checks the values.
    """

    def __init__(self, sidecar: Sidecar, *, name: str = "sidecar") -> None:
        self.sidecar = sidecar
        self.__name__ = name

    async def __call__(self, prompts: list[Prompt], completions: list[str], **fields: list[Any]) -> RewardValues:
        result = await self.sidecar.call(
            "reward.score", {"prompts": prompts, "completions": completions, "fields": fields}
        )
        if not isinstance(result, dict) or not isinstance(result.get("rewards"), list):
            raise SidecarError(
                f'{self.sidecar.who}: reward.score must answer {{"rewards": [...]}}, got {_clip(json.dumps(result))}'
            )
        rewards: RewardValues = result["rewards"]
        return rewards


_EPISODE_IDS = itertools.count()


class SidecarEnv:
    """One episode of an env served by a sidecar (`env.reset`, then `env.step` until done).

    Episodes share the sidecar's process and are told apart by `episode_id`. If the process
    is restarted mid-episode, the episode fails (its state in the sidecar is gone).
    """

    def __init__(self, sidecar: Sidecar, options: Mapping[str, Any]) -> None:
        self.sidecar = sidecar
        self.options = dict(options)
        self.episode_id = f"{os.getpid()}-{next(_EPISODE_IDS)}"
        self.tools: list[ToolSchema] = []
        """The tools the sidecar advertises in `describe` (rendered by the chat template)."""
        self._generation: int | None = None

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        params = {"episode_id": self.episode_id, "row": dict(row), "options": self.options}
        result, self._generation = await self.sidecar.call_on("env.reset", params)
        self.tools = tool_schemas(self.sidecar.info)
        messages = result.get("messages") if isinstance(result, dict) else None
        if not _is_messages(messages):
            raise SidecarError(f'{self.sidecar.who}: env.reset must answer {{"messages": [{{"role", "content"}}, ...]}}')
        return [dict(m) for m in messages]  # type: ignore[union-attr]

    async def step(self, assistant_message: Message) -> StepResult:
        if self._generation is None:
            raise RuntimeError("SidecarEnv.step called before reset")
        params = {"episode_id": self.episode_id, "message": dict(assistant_message)}
        result, _ = await self.sidecar.call_on("env.step", params, generation=self._generation)
        problem = _step_problem(result)
        if problem is not None:
            raise SidecarError(f"{self.sidecar.who}: env.step answered badly: {problem}")
        return StepResult(
            tuple(dict(m) for m in result.get("messages", [])), float(result["reward"]), result["done"],
            result.get("info") or {},
        )


class SidecarEnvFactory:
    """An `EnvFactory`: `factory(**options)` is a fresh `SidecarEnv`; the options go to `env.reset`."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def __call__(self, **options: Any) -> SidecarEnv:
        return SidecarEnv(self.sidecar, options)


async def call_sidecar_tool(sidecar: Sidecar, name: str, arguments: Mapping[str, Any]) -> str:
    """`tool.call` with `{"name", "arguments"}`; the result is `{"content": str}`, what the model reads."""
    result = await sidecar.call("tool.call", {"name": name, "arguments": dict(arguments)})
    if not isinstance(result, dict) or not isinstance(result.get("content"), str):
        raise SidecarError(f'{sidecar.who}: tool.call must answer {{"content": str}}, got {_clip(json.dumps(result))}')
    content: str = result["content"]
    return content


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _step_problem(result: object) -> str | None:
    if not isinstance(result, dict):
        return f"expected an object, got {type(result).__name__}"
    reward = result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return f'"reward" must be a finite number, got {reward!r}'
    if not isinstance(result.get("done"), bool):
        return f'"done" must be true or false, got {result.get("done")!r}'
    if not _is_messages(result.get("messages", [])):
        return '"messages" must be a list of {"role", "content"} objects'
    if not isinstance(result.get("info", {}), dict | None):
        return '"info" must be an object'
    return None
