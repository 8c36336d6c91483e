"""Run untrusted, model-written Python code (SPEC section 9, "Sandbox").

    result = await run_python("print(sum(range(10)))", limits=SandboxLimits(cpu_s=2, wall_s=5))
    assert result.stdout == "45\\n" and result.exit_code == 0
    results = await run_many(completions, limits=limits, concurrency=8)  # input order

Whatever the program does (raise, loop, fork-bomb, flood stdout, exceed a limit) comes back
as data in `ExecResult`; only a sandbox that cannot run at all raises `SandboxError`. When
`run_python` returns, or its task is cancelled, no process the program started is left and
its directory is gone. `SandboxBackend` is the seam for an external sandbox service; the only
backend shipped is `LocalSandbox` (local subprocesses).

What isolation holds where
--------------------------
`LocalSandbox` probes once per process for the strongest layer set the host allows, verifies
each layer from inside a probe program (its uid, its network interfaces, its parent pid, its
root directory), and states the result in every `ExecResult.isolation_note` (and
`LocalSandbox.isolation()`); `network_isolated` is True only with a network namespace.

On every Linux host:
- its own fresh directory (`tempfile.mkdtemp`, removed afterwards) as cwd, HOME and TMPDIR;
  an environment built from nothing (PATH, HOME, TMPDIR, LANG=C.UTF-8, PYTHONHASHSEED=0,
  PYTHONUTF8=1); stdin /dev/null unless given; the interpreter runs `-s -S -B main.py`, i.e.
  `-I` minus `-E` (which would drop PYTHONHASHSEED) and minus `-P` (which would stop main.py
  importing the `files` next to it): no site-packages, no user site, no bytecode files;
- rlimits: CPU, address space, processes, open files, file size, no core dumps; and
  no_new_privs, so setuid binaries grant nothing;
- stdout and stderr capped separately (the rest is read and dropped, never buffered) and the
  program killed at the cap; a wall clock; on either, everything it started is SIGKILLed;
- cleanup of escapees: the supervisor is a child subreaper, so double-forked, setsid()ed
  descendants re-parent to it and are killed and reaped before `run_python` returns.

As root with namespaces (this project's dev VM; most Linux hosts for a root process):
- a unique unprivileged uid/gid per run (`layers.SANDBOX_UID_RANGE`, no groups): it cannot
  read the caller's 0600/0700 files, write anything it does not own, or signal the caller or
  any process of another run; RLIMIT_NPROC binds it (root ignores NPROC) separately per run,
  so a fork bomb neither escapes max_processes nor starves concurrent runs; its leftovers die
  by `kill(-1, SIGKILL)` sent as that uid, which the kernel makes atomic against fork();
- a network namespace: no interfaces but a loopback that is down, so no network at all,
  127.0.0.1 included (`limits.network=True` skips it);
- a pid namespace: it sees and signals only its own processes, and all of them die when the
  program exits (its init is pid 1 and takes the namespace with it);
- a mount namespace with a minimal read-only root (chroot): /usr, /bin, /sbin, /lib* and the
  python prefix (read-only, nosuid), its directory at /sandbox, private size-capped /tmp and
  /dev/shm, /dev/{null,zero,full,random,urandom}, and a /proc of its own. The rest of the host
  (/etc, /home, /root, the project checkout, the run store) does not exist for it.

As root without namespaces (e.g. Docker's default seccomp profile): the unique uid,
rlimits, subreaper and kill-by-uid still hold, so the caller's private files, the caller's
processes and fork bombs are covered, but the program sees the network and every
world-readable file. The uid needs an interpreter it can reach: a python under /root (pyenv)
is not, and then the run falls back to running as root with rlimits only (NPROC then does
not bind), which the note says plainly. Pass `LocalSandbox(python=...)` a world-readable one.

Not root, user namespaces allowed (most desktops and CI runners): user + network + pid +
mount namespaces as above, but the program keeps the caller's uid (the only one mapped), so
max_processes counts all of the caller's processes. Host files outside the minimal root are
invisible; the ones inside are read-only.

Not root and no user namespaces (unprivileged containers, Ubuntu 24.04's AppArmor default):
only the "every host" layer. The program runs as the caller and can read and write whatever
the caller can, and reach the network. Use an external sandbox service there.

Gaps everywhere: no cgroup, so memory_mb bounds each process's address space (a program can
hold max_processes x memory_mb in all) and CPU is bounded per process plus the wall clock; no
disk quota on its directory (max_file_size_mb bounds each file, not their number); no seccomp
filter, so kernel bugs reachable from an unprivileged process are out of scope.
"""

from rollout.sandbox.local import LocalSandbox, default_backend, run_many, run_python
from rollout.sandbox.types import ExecResult, Isolation, SandboxBackend, SandboxError, SandboxLimits

__all__ = [
    "ExecResult",
    "Isolation",
    "LocalSandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
    "default_backend",
    "run_many",
    "run_python",
]
