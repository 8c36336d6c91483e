"""Fixtures for the plugin tests: every test checks that no child process outlives it.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/plugins -q
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def live_children() -> set[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and state != "Z":
            out.add(int(entry))
    return out


@pytest.fixture(autouse=True)
def no_stray_processes():
    """Every sidecar a test starts is gone when it ends (checked, then killed so one failure stays one)."""
    before = live_children()
    yield
    deadline = time.monotonic() + 3.0
    while (left := live_children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"child processes left running: {sorted(left)}"
