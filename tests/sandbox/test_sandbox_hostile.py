"""Hostile programs: each must end within its limits + SLACK_S, leave the host as it was and
leave no process behind (the autouse fixture in conftest.py scans /proc before and after).

The same attacks run against a second backend with namespaces switched off (when we are root
and a world-readable python exists), so the fallback cleanup (child subreaper, kill by uid) is
exercised on hosts that do have namespaces.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_helpers import LIMITS, SLACK_S, run

from rollout.sandbox import Isolation, LocalSandbox, SandboxLimits, run_many


def _world_reachable_python() -> str | None:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.isfile(real) and os.stat(real).st_mode & stat.S_IXOTH:
            return real
    return None


@pytest.fixture(scope="module", params=["strongest", "no-namespaces"])
def hostile_sandbox(request: pytest.FixtureRequest, sandbox: LocalSandbox, sandbox_tmp: str) -> LocalSandbox:
    if request.param == "strongest":
        return sandbox
    python = _world_reachable_python()
    if os.geteuid() != 0 or python is None:
        pytest.skip("the no-namespace variant needs root and a python the sandbox uid can run")
    return LocalSandbox(python=python, tmp_dir=sandbox_tmp, allow_namespaces=False)


def _isolation(sandbox: LocalSandbox) -> Isolation:
    return asyncio.run(sandbox.isolation())


def _protects_files(sandbox: LocalSandbox) -> bool:
    isolation = _isolation(sandbox)
    return isolation.unprivileged_uid or isolation.mount_namespace


def _within_limits(elapsed: float, limits: SandboxLimits = LIMITS) -> None:
    assert elapsed < limits.wall_s + SLACK_S, f"took {elapsed:.2f} s"


def test_infinite_loop_is_killed(hostile_sandbox: LocalSandbox) -> None:
    result, elapsed = run(hostile_sandbox, "while True: pass")
    _within_limits(elapsed)
    assert result.timed_out and result.killed_reason in ("cpu_limit", "wall_timeout")
    assert result.exit_code is None and result.signal is not None


def test_cpu_limit_is_named_when_it_bites(sandbox: LocalSandbox) -> None:
    """cpu_s=1 with a roomy wall clock: SIGXCPU ends it, even if it ignores SIGXCPU (then SIGKILL at 2 s CPU)."""
    limits = SandboxLimits(cpu_s=1, wall_s=5, memory_mb=256)
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    result, elapsed = run(sandbox, code, limits=limits)
    _within_limits(elapsed, limits)
    assert result.timed_out
    if result.killed_reason == "wall_timeout":  # a loaded machine gave it < 2 s of CPU in 5 s
        assert result.cpu_s < 2.05
    else:
        assert result.killed_reason == "cpu_limit" and result.signal == signal.SIGKILL
        assert result.cpu_s >= 1.9


def test_fork_bomb_is_contained(hostile_sandbox: LocalSandbox) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert result.killed_reason in ("wall_timeout", "cpu_limit")
    # Meanwhile the host could still start processes (we are here), and none of the bomb is left.


def test_fork_bombs_do_not_starve_concurrent_runs(sandbox: LocalSandbox) -> None:
    """Each run has its own uid, so RLIMIT_NPROC is per run: bombs next door can't stop a run starting."""
    if not asyncio.run(sandbox.isolation()).unprivileged_uid:
        pytest.skip("max_processes is shared between runs without a uid of their own")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    limits = SandboxLimits(cpu_s=2, wall_s=3, memory_mb=256, max_processes=16)
    started = time.monotonic()
    results = asyncio.run(
        run_many([bomb] * 2 + ["print('fine')"] * 4, limits=limits, concurrency=6, backend=sandbox)
    )
    _within_limits(time.monotonic() - started, limits)
    assert [r.stdout for r in results[2:]] == ["fine\n"] * 4
    assert all(r.timed_out for r in results[:2])


def test_file_size_and_open_files_are_limited(hostile_sandbox: LocalSandbox) -> None:
    limits = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_file_size_mb=1, max_open_files=16)
    code = "\n".join(
        [
            "try:",
            "    handles = [open(f'f{i}', 'w') for i in range(100)]",
            "except OSError as exc:",
            "    print('files', exc.errno)",
            "open('big', 'wb').write(b'x' * 2**21)",
        ]
    )
    result, elapsed = run(hostile_sandbox, code, limits=limits)
    _within_limits(elapsed, limits)
    assert result.stdout == "files 24\n"  # EMFILE
    assert result.exit_code == 1 and result.killed_reason == "file_size", result.stderr


def test_huge_allocation_fails_with_memory_error(hostile_sandbox: LocalSandbox) -> None:
    result, elapsed = run(hostile_sandbox, "x = bytearray(10 * 2**30)\nprint('allocated')")
    _within_limits(elapsed)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.rstrip().endswith("MemoryError") and result.killed_reason == "memory"


def test_gigabyte_of_stdout_is_truncated_fast(hostile_sandbox: LocalSandbox) -> None:
    import resource

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nchunk = b'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.buffer.write(chunk)"
    result, elapsed = run(hostile_sandbox, code)
    assert elapsed < SLACK_S, f"took {elapsed:.2f} s"
    assert result.stdout_truncated and len(result.stdout) == LIMITS.max_output_bytes
    assert result.killed_reason == "output_limit" and result.exit_code is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024  # KiB


def test_stderr_flood_is_truncated(sandbox: LocalSandbox) -> None:
    result, elapsed = run(sandbox, "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)")
    assert elapsed < SLACK_S
    assert result.stderr_truncated and not result.stdout_truncated and result.killed_reason == "output_limit"


@pytest.fixture
def reachable_dir(sandbox_tmp: str) -> Iterator[Path]:
    """A root-owned 0755 dir whose whole path the sandbox uid can traverse (unlike pytest's tmp_path)."""
    path = Path(tempfile.mkdtemp(prefix="host-", dir=sandbox_tmp))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_cannot_write_outside_its_directory(
    hostile_sandbox: LocalSandbox, tmp_path: Path, reachable_dir: Path
) -> None:
    if not _protects_files(hostile_sandbox):
        pytest.skip(f"no file isolation on this host: {_isolation(hostile_sandbox).note}")
    store = tmp_path / "store"  # stands in for the project's run store
    store.mkdir()
    (store / "runs.db").write_text("precious")
    (reachable_dir / "runs.db").write_text("precious")
    targets = [
        store / "runs.db",
        store / "new.db",
        reachable_dir / "runs.db",
        reachable_dir / "new.db",
        Path("/root/.ssh/x"),
        Path("/root/pwned"),
    ]
    if _isolation(hostile_sandbox).mount_namespace:
        world_writable = reachable_dir / "open"  # only the mount layer hides a dir anyone may write
        world_writable.mkdir()
        world_writable.chmod(0o777)
        targets.append(world_writable / "x")
    code = "\n".join(
        [
            "for target in %r:" % [str(t) for t in targets],
            "    try:",
            "        open(target, 'w').write('pwned')",
            "        print('WROTE', target)",
            "    except OSError as exc:",
            "        print('refused', type(exc).__name__)",
        ]
    )
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == len(targets), result.stdout
    assert (store / "runs.db").read_text() == "precious" == (reachable_dir / "runs.db").read_text()
    for target in targets[1:]:
        if target.name != "runs.db":
            assert not target.exists(), target


def test_cannot_read_a_secret_file(
    hostile_sandbox: LocalSandbox, tmp_path: Path, reachable_dir: Path
) -> None:
    if not _protects_files(hostile_sandbox):
        pytest.skip(f"no file isolation on this host: {_isolation(hostile_sandbox).note}")
    secrets = []
    for home in (tmp_path / "home", reachable_dir):  # behind pytest's 0700 dirs, and reachable up to .ssh
        ssh = home / ".ssh"
        ssh.mkdir(parents=True, mode=0o700)
        secret = ssh / "id_ed25519"
        secret.write_text("SECRET-KEY-MATERIAL")
        secret.chmod(0o600)
        secrets.append(str(secret))
    code = "\n".join(
        [
            f"for path in {secrets!r}:",
            "    try:",
            "        print(open(path).read())",
            "    except OSError as exc:",
            "        print('refused', type(exc).__name__)",
        ]
    )
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert result.stdout.count("refused") == 2 and "SECRET" not in result.stdout + result.stderr


def test_detached_grandchild_is_killed(hostile_sandbox: LocalSandbox) -> None:
    code = "\n".join(
        [
            "import os, time",
            "if os.fork() == 0:",
            "    os.setsid()",
            "    if os.fork() == 0:",
            "        os.closerange(0, 3)",  # not even holding the output pipes open
            "        time.sleep(30)",
            "    os._exit(0)",
            "os.wait()",
            "print('parent done')",
        ]
    )
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert result.stdout == "parent done\n" and result.exit_code == 0
    # The autouse fixture asserts the sleeping grandchild is gone.


def test_detached_grandchild_is_killed_on_timeout(hostile_sandbox: LocalSandbox) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\ntime.sleep(30)"
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert result.killed_reason == "wall_timeout"


@pytest.fixture
def listening_port() -> Iterator[tuple[socket.socket, int]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server, server.getsockname()[1]
    server.close()


def test_no_network(hostile_sandbox: LocalSandbox, listening_port: tuple[socket.socket, int]) -> None:
    server, port = listening_port
    code = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n    print('connected')\n"
        "except OSError as exc:\n    print('blocked', exc)"
    )
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    if not result.network_isolated:
        assert "NOT network-isolated" in result.isolation_note
        pytest.skip(f"no network namespace for this backend: {result.isolation_note}")
    assert result.stdout.startswith("blocked"), result.stdout
    with pytest.raises(BlockingIOError):
        server.accept()  # nothing ever connected


def test_cannot_kill_its_parent_or_the_caller(hostile_sandbox: LocalSandbox) -> None:
    code = "\n".join(
        [
            "import os, signal",
            f"for pid in (os.getppid(), {os.getpid()}, 1):",
            "    try:",
            "        os.kill(pid, signal.SIGKILL)",
            "        print('killed', pid)",
            "    except OSError as exc:",
            "        print('refused', type(exc).__name__)",
        ]
    )
    result, elapsed = run(hostile_sandbox, code)
    _within_limits(elapsed)
    assert "killed" not in result.stdout, result.stdout
    assert result.exit_code == 0  # and we, the caller, are still here to check


def test_cancelling_the_caller_kills_the_program(sandbox: LocalSandbox, sandbox_tmp: str) -> None:
    before = set(os.listdir(sandbox_tmp))

    async def cancel_midway() -> float:
        task = asyncio.create_task(sandbox.run_python("import time\ntime.sleep(30)", limits=LIMITS))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    assert asyncio.run(cancel_midway()) < SLACK_S
    assert set(os.listdir(sandbox_tmp)) == before


@pytest.mark.parametrize(
    ("code", "error"),
    [("import no_such_module_rollout", "ModuleNotFoundError"), ("def f(:\n    pass", "SyntaxError")],
)
def test_broken_programs_exit_cleanly(sandbox: LocalSandbox, code: str, error: str) -> None:
    result, elapsed = run(sandbox, code)
    _within_limits(elapsed)
    assert result.exit_code == 1 and result.killed_reason is None and not result.timed_out
    assert "Traceback" in result.stderr or error == "SyntaxError"
    assert error in result.stderr and 'File "' in result.stderr
