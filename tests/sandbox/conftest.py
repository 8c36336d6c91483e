"""Fixtures for the sandbox tests.

    .venv/bin/pytest tests/sandbox -q

Every test here checks afterwards that no process it started is left (see `sandbox_helpers`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from sandbox_helpers import processes, wait_no_strays

from rollout.sandbox import LocalSandbox


@pytest.fixture(scope="session")
def sandbox_tmp() -> Iterator[str]:
    """Where run directories go: a dir of our own (so leaks are countable), reachable by the sandbox uid."""
    path = tempfile.mkdtemp(prefix="rollout-sandbox-tests-")
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="session")
def sandbox(sandbox_tmp: str) -> LocalSandbox:
    return LocalSandbox(tmp_dir=sandbox_tmp)


@pytest.fixture(autouse=True)
def _no_stray_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No process this test started survives it: neither a descendant of this process nor one
    running as a sandbox uid this process claimed during the test (recorded by wrapping
    `_claim_uid`; other xdist workers' sandbox programs run under other uids of the range)."""
    claimed: set[int] = set()
    claim = LocalSandbox._claim_uid

    def recording_claim(self: LocalSandbox) -> int:
        uid = claim(self)
        claimed.add(uid)
        return uid

    monkeypatch.setattr(LocalSandbox, "_claim_uid", recording_claim)
    before = processes()
    yield
    strays = wait_no_strays(before, claimed)
    assert not strays, f"processes left behind: {strays}"
