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
def _no_stray_processes() -> Iterator[None]:
    before = processes()
    yield
    strays = wait_no_strays(before)
    assert not strays, f"processes left behind: {strays}"
