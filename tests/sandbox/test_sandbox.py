"""The sandbox doing its ordinary job: output, exit codes, stdin, files, limits, run_many, no leaks."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Mapping

import pytest
from sandbox_helpers import LIMITS, processes, run

from rollout.errors import ConfigError
from rollout.sandbox import (
    ExecResult,
    LocalSandbox,
    SandboxBackend,
    SandboxLimits,
    run_many,
    run_python,
)


def test_prints_and_exits_zero(sandbox: LocalSandbox) -> None:
    result, _ = run(sandbox, "print('hello', 6 * 7)")
    assert result.stdout == "hello 42\n"
    assert result.stderr == ""
    assert result.exit_code == 0 and result.signal is None
    assert result.ok and not result.timed_out and result.killed_reason is None
    assert result.cpu_s >= 0 and result.max_rss_kb > 0 and result.wall_s > 0
    assert result.isolation_note


def test_exit_code_and_traceback_are_reported(sandbox: LocalSandbox) -> None:
    result, _ = run(sandbox, "import sys\nprint('partial')\nsys.stderr.write('bad\\n')\nraise SystemExit(3)")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "partial\n", "bad\n")
    assert not result.ok


def test_stdin_is_given_or_empty(sandbox: LocalSandbox) -> None:
    result, _ = run(sandbox, "import sys\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert result.stdout == "cba\n"
    result, _ = run(sandbox, "import sys\nprint(repr(sys.stdin.read()))")
    assert result.stdout == "''\n"  # /dev/null


def test_unread_large_stdin_does_not_hang(sandbox: LocalSandbox) -> None:
    result, elapsed = run(sandbox, "print('ignored stdin')", stdin="x" * (4 * 2**20))
    assert result.stdout == "ignored stdin\n" and result.exit_code == 0
    assert elapsed < LIMITS.wall_s


def test_files_sit_next_to_main_and_are_importable(sandbox: LocalSandbox) -> None:
    code = "import helper\nprint(helper.X + int(open('data/n.txt').read()))"
    result, _ = run(sandbox, code, files={"helper.py": "X = 40\n", "data/n.txt": "2"})
    assert result.stdout == "42\n", result.stderr


@pytest.mark.parametrize("name", ["../escape.py", "/etc/x", "main.py", "", "a/../../b"])
def test_bad_file_names_are_refused(sandbox: LocalSandbox, name: str) -> None:
    with pytest.raises(ValueError, match="relative path"):
        run(sandbox, "pass", files={name: "x"})


def test_environment_is_clean_and_hash_seed_fixed(sandbox: LocalSandbox) -> None:
    os.environ["ROLLOUT_SANDBOX_CANARY"] = "leaked"
    try:
        code = "import os, sys\nprint(sorted(os.environ))\nprint(hash('abc'))\nprint(sys.flags.no_site, os.getcwd() == os.environ['HOME'])"
        first, _ = run(sandbox, code)
        second, _ = run(sandbox, code)
    finally:
        del os.environ["ROLLOUT_SANDBOX_CANARY"]
    names, seed_hash, flags = first.stdout.splitlines()
    assert names == str(sorted(["HOME", "LANG", "PATH", "PYTHONHASHSEED", "PYTHONUTF8", "TMPDIR"]))
    assert "leaked" not in first.stdout
    assert second.stdout.splitlines()[1] == seed_hash  # PYTHONHASHSEED=0 reaches the interpreter
    assert flags == "1 True"


def test_no_site_packages(sandbox: LocalSandbox) -> None:
    result, _ = run(sandbox, "import pydantic")
    assert result.exit_code == 1 and "ModuleNotFoundError" in result.stderr


def test_limits_are_validated() -> None:
    for bad in (
        {"cpu_s": 0},
        {"wall_s": -1.0},
        {"wall_s": float("inf")},
        {"memory_mb": 8},
        {"max_processes": 0},
        {"max_open_files": 2},
        {"max_output_bytes": -1},
        {"cpu_s": True},
        {"network": "no"},
    ):
        with pytest.raises(ConfigError, match="sandbox limits"):
            SandboxLimits(**bad)  # type: ignore[arg-type]
    assert SandboxLimits().memory_mb == 512


def test_run_dirs_are_removed(sandbox: LocalSandbox, sandbox_tmp: str) -> None:
    before = set(os.listdir(sandbox_tmp))
    run(sandbox, "open('left.txt', 'w').write('x'); import os; os.makedirs('a/b'); os.chmod('a', 0)")
    run(sandbox, "import time; time.sleep(30)")  # killed at the wall limit
    assert set(os.listdir(sandbox_tmp)) == before


def test_run_many_keeps_order_and_leaks_nothing(sandbox: LocalSandbox, sandbox_tmp: str) -> None:
    """200 programs, 16 at a time: results in input order; no fd, child or run dir left."""
    fds_before = set(os.listdir("/proc/self/fd"))
    dirs_before = set(os.listdir(sandbox_tmp))
    me = os.getpid()
    children_before = {pid for pid, (ppid, _) in processes().items() if ppid == me}  # other tests' servers
    codes = [f"print({i} * {i})" for i in range(200)]
    results = asyncio.run(run_many(codes, limits=LIMITS, concurrency=16, backend=sandbox))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]
    assert all(r.exit_code == 0 for r in results)
    assert set(os.listdir("/proc/self/fd")) == fds_before
    assert set(os.listdir(sandbox_tmp)) == dirs_before
    assert [pid for pid, (ppid, _) in processes().items() if ppid == me and pid not in children_before] == []


def test_run_many_rejects_zero_concurrency() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_many(["pass"], concurrency=0))


def test_module_functions_use_the_default_backend() -> None:
    result = asyncio.run(run_python("print('default')", limits=LIMITS))
    assert result.stdout == "default\n"


def test_backend_seam_takes_any_implementation(sandbox: LocalSandbox) -> None:
    """run_many drives whatever SandboxBackend it is given (the seam for an external service)."""

    class Echo:
        async def run_python(
            self,
            code: str,
            *,
            limits: SandboxLimits,
            stdin: str | None = None,
            files: Mapping[str, str] | None = None,
        ) -> ExecResult:
            return ExecResult(code, "", 0, None, False, None, False, False, 0.0, 0.0, 0, False, "echo")

    assert isinstance(sandbox, SandboxBackend) and isinstance(Echo(), SandboxBackend)
    results = asyncio.run(run_many(["a", "b", "c"], backend=Echo(), concurrency=2))
    assert [r.stdout for r in results] == ["a", "b", "c"]


def test_isolation_is_probed_and_reported(sandbox: LocalSandbox) -> None:
    isolation = asyncio.run(sandbox.isolation())
    result, _ = run(sandbox, "pass")
    assert result.isolation_note == isolation.note
    assert result.network_isolated == isolation.network_namespace
    if os.geteuid() == 0:
        assert isolation.unprivileged_uid or "runs as root" in isolation.note
    allowed = asyncio.run(sandbox.isolation(network=True))
    assert not allowed.network_namespace and "network allowed" in allowed.note


def _namespaces_work() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--net", "--pid", "--mount", "--fork", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def test_strongest_isolation_where_the_host_allows_it(sandbox: LocalSandbox) -> None:
    """As root with namespaces (this machine), no layer may be lost silently: the file and network
    tests skip on weaker hosts, so this is what keeps them honest here."""
    if os.geteuid() != 0 or not _namespaces_work():
        pytest.skip("needs root and unshare(1) with net/pid/mount namespaces")
    isolation = asyncio.run(sandbox.isolation())
    assert isolation.unprivileged_uid and isolation.network_namespace
    assert isolation.pid_namespace and isolation.mount_namespace, isolation.note
