"""Sandbox data types and the backend interface: `SandboxLimits`, `ExecResult`, `Isolation`, `SandboxBackend`.

No process handling here; `local.py` implements the one backend that exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rollout.errors import ConfigError, RolloutError


class SandboxError(RolloutError):
    """The sandbox itself failed (could not start, lost its supervisor); not the program's fault.

    A program that crashes, times out or hits a limit is *not* an error: that is an
    `ExecResult` with a nonzero `exit_code` or a `killed_reason`.
    """


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use. All limits hold per run.

    `cpu_s` is enforced by RLIMIT_CPU, which counts whole seconds: it is rounded up, and a
    program that ignores SIGXCPU is SIGKILLed one second later. `memory_mb` is address space
    (RLIMIT_AS), not resident memory: allocations beyond it fail (`MemoryError`).
    `max_output_bytes` applies to stdout and stderr separately; past it the bytes are dropped
    and the program is killed. `max_processes` counts processes and threads of the sandbox's
    uid (see the package docstring for when that uid is shared).
    """

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 64 * 1024
    max_processes: int = 32
    max_open_files: int = 64
    max_file_size_mb: int = 16
    network: bool = False
    """True lets the program reach the network (no network namespace is created)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(
                    f"sandbox limits: {name} must be a positive number of seconds, got {value!r}"
                )
        minimums = {
            "memory_mb": 32,  # the interpreter alone maps ~20 MiB
            "max_output_bytes": 0,
            "max_processes": 1,
            "max_open_files": 8,  # stdio plus what the interpreter opens at start-up
            "max_file_size_mb": 0,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"sandbox limits: {name} must be an integer >= {minimum}, got {value!r}")
        if not isinstance(self.network, bool):
            raise ConfigError(f"sandbox limits: network must be true or false, got {self.network!r}")


@dataclass(frozen=True)
class ExecResult:
    """How one sandboxed program ended, with what it printed (both streams capped).

    Exactly one of `exit_code` (it exited) and `signal` (it was killed) is set, except when the
    program's exit status was lost with its namespace, where both may be None and
    `killed_reason` says why. `killed_reason` names the limit that ended the program:
    "wall_timeout", "cpu_limit", "memory" (it died of an uncaught `MemoryError`), "file_size"
    (SIGXFSZ, or an uncaught EFBIG `OSError`), "output_limit", or "cancelled" (the caller's task
    was cancelled); None when it ended on its own.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    """True for "wall_timeout" and "cpu_limit"."""
    killed_reason: str | None
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    """Wall-clock seconds of the whole run, set-up and clean-up included."""
    cpu_s: float
    """User + system CPU seconds of the program and the descendants it waited for."""
    max_rss_kb: int
    network_isolated: bool
    isolation_note: str
    """Which isolation layers held for this run, in words."""

    @property
    def ok(self) -> bool:
        """The program exited 0 on its own, with its output complete."""
        return (
            self.exit_code == 0
            and self.killed_reason is None
            and not self.stdout_truncated
            and not self.stderr_truncated
        )


@dataclass(frozen=True)
class Isolation:
    """Which isolation layers a backend gives its programs on this host (found by probing)."""

    unprivileged_uid: bool
    """The program runs as a uid of its own with no capabilities (needs root to set up)."""
    user_namespace: bool
    network_namespace: bool
    pid_namespace: bool
    mount_namespace: bool
    """The program sees a minimal read-only root: system libraries, python, its own directory."""
    note: str


@runtime_checkable
class SandboxBackend(Protocol):
    """Runs one untrusted Python program and reports how it ended.

    This is the seam for an external sandbox service (a remote executor, gVisor, Firecracker):
    implement `run_python` with the same contract and pass the object as `backend=` to
    `run_python`/`run_many`. The contract: the program's failures (crash, timeout, limits) come
    back as an `ExecResult`; only a failure of the sandbox itself raises (`SandboxError`); when
    the call returns or is cancelled, nothing the program started is still running.
    `rollout.sandbox.local.LocalSandbox` is the only implementation shipped.
    """

    async def run_python(
        self,
        code: str,
        *,
        limits: SandboxLimits,
        stdin: str | None = None,
        files: Mapping[str, str] | None = None,
    ) -> ExecResult: ...
