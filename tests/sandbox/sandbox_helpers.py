"""Helpers for the sandbox tests: a /proc scanner for stray processes and a small runner."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection, Mapping

from rollout.sandbox import ExecResult, LocalSandbox, SandboxLimits

# Short limits keep the suite fast on 2 shared cores; the bounds the hostile tests assert are
# these plus SLACK_S.
LIMITS = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_processes=16, max_output_bytes=64 * 1024)
SLACK_S = 2.0


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, real uid) for every process on the host, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited while we looked
        found[int(entry)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]))
    return found


def stray_processes(before: Mapping[int, tuple[int, int]], uids: Collection[int]) -> list[str]:
    """Processes new since `before` that run as one of `uids` or descend from this test process.

    `uids` are the sandbox uids this process handed out (see conftest.py), not the whole
    SANDBOX_UID_RANGE: under pytest-xdist another worker's sandbox programs (a fork bomb, a
    code-execution env test) run at the same time as ours, under uids of that range.
    """
    me = os.getpid()
    now = processes()
    strays = []
    for pid, (ppid, uid) in now.items():
        if pid in before or pid == me:
            continue
        ancestors, cursor = [], ppid
        while cursor > 1 and cursor not in ancestors:
            ancestors.append(cursor)
            cursor = now.get(cursor, (0, 0))[0]
        if uid in uids or me in ancestors:
            strays.append(f"pid {pid} uid {uid} ppid {ppid}")
    return strays


def wait_no_strays(before: Mapping[int, tuple[int, int]], uids: Collection[int], grace_s: float = 0.0) -> list[str]:
    deadline = time.monotonic() + grace_s
    while (strays := stray_processes(before, uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return strays


def run(
    sandbox: LocalSandbox,
    code: str,
    *,
    limits: SandboxLimits = LIMITS,
    stdin: str | None = None,
    files: Mapping[str, str] | None = None,
) -> tuple[ExecResult, float]:
    """Run one program; return its result and the seconds the call took as the caller saw them."""
    started = time.monotonic()
    result = asyncio.run(sandbox.run_python(code, limits=limits, stdin=stdin, files=files))
    return result, time.monotonic() - started
