"""The local backend: each program runs under `_supervisor.py` in a subprocess of this one.

`LocalSandbox` finds, once per process and per `limits.network`, the strongest set of layers
this host allows by running a probe program under each candidate (strongest first, see
`layers.py`) and checking from inside that each claimed layer holds. Every later run asks the
supervisor for exactly those layers, and a run whose layers fail to come up raises
`SandboxError` rather than running with less.

Here, per run: a fresh `tempfile.mkdtemp` directory holds `work/` (the program's directory:
`main.py` and `files`) and `root/` (an empty mount point for the minimal root); it is removed
when the run ends, however it ends. stdout and stderr are read concurrently and capped; past
the cap the bytes are dropped and the supervisor is told (SIGUSR1) to kill the program.

About 580 lines on purpose: the isolation layers are probed, combined and torn
down in one place, so what a run was actually given (and what not) is decided by
one reader-visible path; the code that runs inside the sandbox is `_supervisor.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import marshal
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rollout.sandbox.layers import (
    PROBE_CODE,
    SANDBOX_DIR,
    SANDBOX_UID_RANGE,
    TMPFS_MB,
    Layers,
    candidate_layers,
    check_probe_facts,
    describe_layers,
    uid_range_mapped,
)
from rollout.sandbox.types import ExecResult, Isolation, SandboxBackend, SandboxError, SandboxLimits

_SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))
_PROGRAM = "main.py"
_BACKSTOP_S = 15.0  # beyond wall_s before we stop trusting the supervisor: start-up, root, clean-up
_DRAIN_S = 5.0  # after the supervisor exits, its pipes must close within this
_SUPERVISOR_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

_NO_USAGE = {"utime": 0.0, "stime": 0.0, "maxrss": 0}  # the program's usage died with its namespace

_active_uids: set[int] = set()
_uid_lock = threading.Lock()


@dataclass
class _Run:
    """One prepared run: its directory on the host and the supervisor's config."""

    dir: str
    uid: int | None
    config: dict[str, Any]


def _interpreter_paths(python: str | None) -> tuple[str, list[str]]:
    """The interpreter to exec and the directories it needs (shown read-only under the mount layer)."""
    if python is None:
        exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        prefixes = [os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)]
    else:
        exe = os.path.realpath(python)
        prefixes = [os.path.dirname(os.path.dirname(exe))]  # <prefix>/bin/python
    expose: list[str] = []
    for path in sorted({*prefixes, os.path.dirname(exe)}):
        if path == "/":
            continue  # a python in /bin: its libraries are in the system dirs, shown anyway
        if not any(path == p or path.startswith(p + "/") for p in expose):
            expose.append(path)
    return exe, expose


def _kill_uid_command(uid: int) -> list[str]:
    """The last-resort cleanup: SIGKILL every process of a sandbox uid (see `_supervisor.kill_uid`)."""
    return [sys.executable, "-I", "-S", "-B", _SUPERVISOR, "--kill-uid", str(uid)]


def _check_file_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if not name or "\0" in name or path.is_absolute() or ".." in path.parts or str(path) in (".", _PROGRAM):
        raise ValueError(
            f"sandbox files: {name!r} must be a relative path inside the work dir, not {_PROGRAM!r}"
        )
    return path


def _remove_tree(path: str) -> None:
    """rmtree that also works on directories the program made unreadable (chmod 000)."""

    def make_writable_and_retry(func: Any, failed: str, _exc: Any) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
            shutil.rmtree(failed)
        else:
            func(failed)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _read_report(fd: int) -> list[dict[str, Any]]:
    """The supervisor's events: frames of a 4-byte little-endian length and a marshalled dict."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):  # nothing more buffered: the writers are gone
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    events = []
    while data:
        size = int.from_bytes(data[:4], "little")
        events.append(marshal.loads(data[4 : 4 + size]))
        data = data[4 + size :]
    return events


def _decode_result(
    events: list[dict[str, Any]],
    *,
    stdout: tuple[bytes, bool],
    stderr: tuple[bytes, bool],
    supervisor_exit: int | None,
    layers: Layers,
    isolation: Isolation,
    limits: SandboxLimits,
    started: float,
) -> ExecResult:
    """Turn the supervisor's report and the captured output into an `ExecResult`."""
    errors = [e["message"] for e in events if e["event"] == "error"]
    if errors:
        raise SandboxError(f"sandbox failed ({layers.name()}): {errors[0]}")
    result = next((e for e in events if e["event"] == "result"), None)
    if result is None:
        raise SandboxError(f"sandbox supervisor exited with code {supervisor_exit} without a report")
    program = result
    if layers.pid:  # the supervisor's child was init; the program's own status comes from init
        program = next((e for e in events if e["event"] == "program_exit"), {"status": None, **_NO_USAGE})
    status = program["status"]
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else None
    sig = None
    if exit_code is not None and exit_code < 0:
        exit_code, sig = None, -exit_code
    if status is None and result["reason"] is not None:
        sig = signal.SIGKILL  # killed together with its namespace
    cpu_s = program["utime"] + program["stime"]
    out_text = stdout[0].decode("utf-8", errors="replace")
    err_text = stderr[0].decode("utf-8", errors="replace")
    killed_reason = _decide_killed_reason(result["reason"], sig, exit_code, cpu_s, err_text, limits)
    return ExecResult(
        stdout=out_text,
        stderr=err_text,
        exit_code=exit_code,
        signal=sig,
        timed_out=killed_reason in ("wall_timeout", "cpu_limit"),
        killed_reason=killed_reason,
        stdout_truncated=stdout[1],
        stderr_truncated=stderr[1],
        wall_s=time.monotonic() - started,
        cpu_s=cpu_s,
        max_rss_kb=int(program["maxrss"]),
        network_isolated=layers.net,
        isolation_note=isolation.note,
    )


def _decide_killed_reason(
    reason: str | None,
    sig: int | None,
    exit_code: int | None,
    cpu_s: float,
    stderr: str,
    limits: SandboxLimits,
) -> str | None:
    if reason is not None:
        return reason
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= math.ceil(limits.cpu_s) - 0.05):
        return "cpu_limit"  # SIGXCPU at the soft limit, SIGKILL at the hard one (soft + 1 s)
    if sig == signal.SIGXFSZ:
        return "file_size"
    # Python ignores SIGXFSZ and turns both limits into exceptions; an uncaught one names the limit.
    last_line = (stderr.rstrip().splitlines() or [""])[-1]
    if exit_code not in (0, None) and last_line.startswith("MemoryError"):
        return "memory"
    if exit_code not in (0, None) and last_line.startswith("OSError: [Errno 27]"):
        return "file_size"
    return None


class LocalSandbox:
    """The local subprocess backend (see the package docstring for what isolation holds where).

    `python` is the interpreter the programs run (default: this process's base interpreter;
    programs get its standard library only, never this virtualenv's packages). `tmp_dir` is
    where run directories go (default: `tempfile.gettempdir()`). `allow_namespaces` and
    `allow_uid_switch` exist to test the degraded paths; leave them on otherwise.
    """

    def __init__(
        self,
        *,
        python: str | None = None,
        tmp_dir: str | os.PathLike[str] | None = None,
        allow_namespaces: bool = True,
        allow_uid_switch: bool = True,
    ) -> None:
        self._exe, self._expose = _interpreter_paths(python)
        self._tmp_dir = os.fspath(tmp_dir) if tmp_dir is not None else None
        self._allow_namespaces = allow_namespaces
        self._allow_uid_switch = allow_uid_switch
        self._probed: dict[bool, tuple[Layers, Isolation]] = {}
        self._probe_lock = threading.Lock()

    # ------------------------------------------------------------------------------ isolation

    async def isolation(self, *, network: bool = False) -> Isolation:
        """What holds for programs run with `limits.network == network` (probed once, then cached)."""
        return (await self._layers(network))[1]

    async def _layers(self, network: bool) -> tuple[Layers, Isolation]:
        if network not in self._probed:
            await asyncio.to_thread(self._probe, network)
        return self._probed[network]

    def _probe(self, network: bool) -> None:
        with self._probe_lock:
            if network in self._probed:
                return
            is_root = os.geteuid() == 0
            uid_ok = self._allow_uid_switch and is_root and uid_range_mapped()
            candidates = candidate_layers(
                is_root=is_root, uid_ok=uid_ok, namespaces_ok=self._allow_namespaces, network=network
            )
            limits = SandboxLimits(cpu_s=5, wall_s=15, network=network)
            failures: list[str] = []
            for layers in candidates:
                problem = self._try_layers(layers, limits)
                if problem is None:
                    note = describe_layers(layers, is_root=is_root, network=network, failures=failures)
                    isolation = Isolation(
                        unprivileged_uid=layers.uid,
                        user_namespace=layers.userns,
                        network_namespace=layers.net,
                        pid_namespace=layers.pid,
                        mount_namespace=layers.mount,
                        note=note,
                    )
                    self._probed[network] = (layers, isolation)
                    return
                failures.append(f"{layers.name()}: {problem}")
            raise SandboxError("no sandbox configuration works on this host", details=failures)

    def _try_layers(self, layers: Layers, limits: SandboxLimits) -> str | None:
        """Run the probe program under `layers`; None if every layer verifiably held, else why not."""
        run = self._prepare(PROBE_CODE, None, layers, limits)
        try:
            report_r, report_w = os.pipe()
            try:
                proc = subprocess.run(
                    self._command(run, report_w),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    pass_fds=(report_w,),
                    start_new_session=True,
                    env=_SUPERVISOR_ENV,
                    timeout=limits.wall_s + _BACKSTOP_S,
                    check=False,
                )
                os.close(report_w)
                report_w = -1
                events = _read_report(report_r)
            finally:
                os.close(report_r)
                if report_w >= 0:
                    os.close(report_w)
            errors = [e["message"] for e in events if e["event"] == "error"]
            if errors:
                return errors[0]
            if proc.returncode != 0 or not proc.stdout.strip():
                return f"probe failed (supervisor exit {proc.returncode}): {proc.stderr.decode()[-300:]!r}"
            return check_probe_facts(layers, json.loads(proc.stdout), uid=run.uid)
        except subprocess.TimeoutExpired:
            if run.uid is not None:  # only the supervisor was killed; its program may live on
                subprocess.run(_kill_uid_command(run.uid), env=_SUPERVISOR_ENV, check=True)
            return f"probe did not finish within {limits.wall_s + _BACKSTOP_S:.0f} s"
        except (OSError, ValueError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            self._finish(run)

    # ------------------------------------------------------------------------------ one run

    def _prepare(
        self, code: str, files: Mapping[str, str] | None, layers: Layers, limits: SandboxLimits
    ) -> _Run:
        checked = {_check_file_name(name): text for name, text in (files or {}).items()}
        uid = self._claim_uid() if layers.uid else None
        run_dir = tempfile.mkdtemp(prefix="rollout-sandbox-", dir=self._tmp_dir)
        try:
            work = os.path.join(run_dir, "work")
            os.mkdir(work, 0o700)
            # surrogatepass: model output may hold lone surrogates; the program, not we, should fail on them
            (Path(work) / _PROGRAM).write_bytes(code.encode("utf-8", "surrogatepass"))
            for rel, text in checked.items():
                (Path(work) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(work) / rel).write_bytes(text.encode("utf-8", "surrogatepass"))
            root_mountpoint = None
            if layers.mount:
                root_mountpoint = os.path.join(run_dir, "root")
                os.mkdir(root_mountpoint, 0o700)
            if uid is not None:
                # Without the mount layer the program's uid must be able to reach work/.
                os.chmod(run_dir, 0o711)
                for dirpath, dirnames, filenames in os.walk(work):
                    os.chown(dirpath, uid, uid)
                    for name in dirnames + filenames:
                        os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
        except BaseException:
            _remove_tree(run_dir)
            self._release_uid(uid)
            raise
        sandbox_dir = SANDBOX_DIR if layers.mount else work
        config = {
            "exe": self._exe,
            # -I would be -E -P -s. -E is pointless (the environment below is built from nothing)
            # and would drop PYTHONHASHSEED; -P would stop main.py importing the modules in `files`.
            "argv": [self._exe, "-s", "-S", "-B", _PROGRAM],
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": sandbox_dir,
                "TMPDIR": sandbox_dir,
                "LANG": "C.UTF-8",
                "PYTHONHASHSEED": "0",
                "PYTHONUTF8": "1",
            },
            "workdir": work,
            "sandbox_dir": sandbox_dir,
            "root_mountpoint": root_mountpoint,
            "expose": self._expose,
            "tmpfs_mb": TMPFS_MB,
            "uid": uid,
            "gid": uid,
            "uid_unique": uid is not None,
            "userns": layers.userns,
            "net": layers.net,
            "pid": layers.pid,
            "mount": layers.mount,
            "wall_s": limits.wall_s,
            "rlimits": {
                "cpu_s": math.ceil(limits.cpu_s),
                "as_bytes": limits.memory_mb * 2**20,
                "nofile": limits.max_open_files,
                "fsize_bytes": limits.max_file_size_mb * 2**20,
                "nproc": limits.max_processes,
            },
        }
        return _Run(dir=run_dir, uid=uid, config=config)

    def _command(self, run: _Run, report_fd: int) -> list[str]:
        config = marshal.dumps({**run.config, "report_fd": report_fd}).hex()
        return [sys.executable, "-I", "-S", "-B", _SUPERVISOR, config]

    def _finish(self, run: _Run) -> None:
        try:
            _remove_tree(run.dir)
        finally:
            self._release_uid(run.uid)

    def _claim_uid(self) -> int:
        with _uid_lock:
            while True:
                uid = SANDBOX_UID_RANGE[secrets.randbelow(len(SANDBOX_UID_RANGE))]
                if uid not in _active_uids:
                    _active_uids.add(uid)
                    return uid

    def _release_uid(self, uid: int | None) -> None:
        if uid is not None:
            with _uid_lock:
                _active_uids.discard(uid)

    async def run_python(
        self,
        code: str,
        *,
        limits: SandboxLimits = SandboxLimits(),
        stdin: str | None = None,
        files: Mapping[str, str] | None = None,
    ) -> ExecResult:
        started = time.monotonic()
        layers, isolation = await self._layers(limits.network)
        run = self._prepare(code, files, layers, limits)
        try:
            return await self._supervise(run, layers, isolation, limits, stdin, started)
        finally:
            await asyncio.to_thread(self._finish, run)

    async def _supervise(
        self,
        run: _Run,
        layers: Layers,
        isolation: Isolation,
        limits: SandboxLimits,
        stdin: str | None,
        started: float,
    ) -> ExecResult:
        report_r, report_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command(run, report_w),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(report_w,),
                start_new_session=True,
                env=_SUPERVISOR_ENV,
            )
        except BaseException:
            os.close(report_r)
            os.close(report_w)
            raise
        os.close(report_w)
        try:
            return await self._collect(proc, run, layers, isolation, limits, stdin, started, report_r)
        except BaseException:
            await asyncio.shield(self._stop(proc, run))
            raise
        finally:
            os.close(report_r)

    async def _collect(
        self,
        proc: asyncio.subprocess.Process,
        run: _Run,
        layers: Layers,
        isolation: Isolation,
        limits: SandboxLimits,
        stdin: str | None,
        started: float,
        report_r: int,
    ) -> ExecResult:
        asked_to_kill = False

        def kill_for_output() -> None:
            nonlocal asked_to_kill
            if not asked_to_kill and proc.returncode is None:
                asked_to_kill = True
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    proc.send_signal(signal.SIGUSR1)

        assert proc.stdout is not None and proc.stderr is not None
        out = asyncio.create_task(_read_capped(proc.stdout, limits.max_output_bytes, kill_for_output))
        err = asyncio.create_task(_read_capped(proc.stderr, limits.max_output_bytes, kill_for_output))
        tasks: list[asyncio.Task[Any]] = [out, err]
        if stdin is not None:
            assert proc.stdin is not None
            tasks.append(asyncio.create_task(_feed(proc.stdin, stdin.encode("utf-8", "surrogatepass"))))
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout=limits.wall_s + _BACKSTOP_S)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox supervisor did not finish within {limits.wall_s + _BACKSTOP_S:.0f} s"
                ) from None
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=_DRAIN_S)
            except TimeoutError:
                raise SandboxError(
                    "a sandboxed process kept the output pipes open after the supervisor exited"
                ) from None
        finally:
            for task in tasks:
                task.cancel()
        return _decode_result(
            _read_report(report_r),
            stdout=out.result(),
            stderr=err.result(),
            supervisor_exit=proc.returncode,
            layers=layers,
            isolation=isolation,
            limits=limits,
            started=started,
        )

    async def _stop(self, proc: asyncio.subprocess.Process, run: _Run) -> None:
        """Cancellation or a hung supervisor: ask it to kill everything, then make sure."""
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout=5.0)
                return
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # init has PDEATHSIG=SIGKILL: the pid namespace goes with it
                await proc.wait()
        if run.uid is not None:
            killer = await asyncio.create_subprocess_exec(*_kill_uid_command(run.uid), env=_SUPERVISOR_ENV)
            await killer.wait()


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow: Any) -> tuple[bytes, bool]:
    """Read to EOF keeping at most `cap` bytes; the first byte past it calls `on_overflow` once."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(1 << 16):
        room = cap - len(kept)
        if len(chunk) > room:
            kept += chunk[:room]
            if not truncated:
                truncated = True
                on_overflow()
        else:
            kept += chunk
    return bytes(kept), truncated


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stream.write(data)
        await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all its stdin; that is its business
    finally:
        stream.close()


_default: LocalSandbox | None = None


def default_backend() -> LocalSandbox:
    """The process-wide `LocalSandbox` that `run_python`/`run_many` use when given no backend."""
    global _default
    if _default is None:
        _default = LocalSandbox()
    return _default


async def run_python(
    code: str,
    *,
    limits: SandboxLimits = SandboxLimits(),
    stdin: str | None = None,
    files: Mapping[str, str] | None = None,
    backend: SandboxBackend | None = None,
) -> ExecResult:
    """Run `code` as `main.py` in a fresh sandbox (next to `files`, relative path -> text) and report how it ended."""
    chosen = backend if backend is not None else default_backend()
    return await chosen.run_python(code, limits=limits, stdin=stdin, files=files)


async def run_many(
    codes: Sequence[str],
    *,
    limits: SandboxLimits = SandboxLimits(),
    concurrency: int = 8,
    backend: SandboxBackend | None = None,
) -> list[ExecResult]:
    """Run each program in its own sandbox, at most `concurrency` at a time; results in input order."""
    if concurrency < 1:
        raise ValueError(f"run_many: concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def run_one(code: str) -> ExecResult:
        async with gate:
            return await run_python(code, limits=limits, backend=backend)

    async with asyncio.TaskGroup() as group:  # one failure cancels (and so cleans up) the rest
        tasks = [group.create_task(run_one(code)) for code in codes]
    return [task.result() for task in tasks]
