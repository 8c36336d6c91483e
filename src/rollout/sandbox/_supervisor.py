"""The sandbox supervisor: runs one untrusted Python program, then makes sure nothing it started survives.

`rollout.sandbox.local` starts it as `python -I -S -B _supervisor.py CONFIG`, as the caller's
own user, where CONFIG is a hex-encoded `marshal` dict (the caller runs this same interpreter).
It imports only the standard library: `-I -S` keep site-packages (and so `rollout` itself) off
its path. Start-up cost matters (one supervisor per program), hence marshal rather than json
(which drags in `re`) and no `traceback` import unless something fails. The config is built by
`local.py`; every layer it asks for was found to work by that module's probe, so any failure
here is reported as an `error` event and never silently skipped.

Process tree (the pid layer on; without it `init` is absent and the supervisor forks the
program directly):

    caller (asyncio)                      reads stdout/stderr (capped) and the report pipe
    └─ supervisor   (caller's uid)       child subreaper; enters the new namespaces; wall clock
       └─ init      (pid 1 of a new pid namespace)   builds the minimal root, reaps orphans
          └─ program  (unique unprivileged uid)      rlimits, no_new_privs, execs python main.py

Why each piece:
- The supervisor is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so a program that
  double-forks and setsid()s re-parents its orphans here, where they can be found and killed.
- Killing pid 1 of a pid namespace makes the kernel SIGKILL every process in it, and pid 1
  exits as soon as the program does, so a detached daemon dies with its creator.
- With a unique uid, `kill(-1, SIGKILL)` sent *as that uid* reaches exactly the program's
  processes, and the kernel makes it atomic with respect to fork() (a fork bomb can't outrun it).
- init gets PR_SET_PDEATHSIG=SIGKILL: if the supervisor itself is killed, the namespace goes too.

Report protocol: frames of a 4-byte little-endian length and a `marshal`led dict, on
`report_fd` (a pipe only the caller reads):
`{"event": "error", "message": ...}` for a setup failure, `{"event": "program_exit", "status",
"utime", "stime", "maxrss"}` from init (pid layer), and finally `{"event": "result", "status",
"utime", "stime", "maxrss", "reason"}` for the supervisor's direct child.

`_supervisor.py --kill-uid UID` kills every process of UID (the caller's last-resort cleanup).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import select
import signal
import sys
import time
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

# Top-level host directories the minimal root shows (read-only): the dynamic loader, libc and
# the shared libraries python's extension modules link against. Symlinks (merged /usr) are
# re-created as symlinks. Nothing else of the host (no /etc, /home, /root, /work, /var) is visible.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
SANDBOX_DIR = "/sandbox"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

_report_fd = -1


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(data)), f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _report(**event: Any) -> None:
    # Each frame is far below PIPE_BUF, so writes from init and the supervisor never interleave.
    data = marshal.dumps(event)
    os.write(_report_fd, len(data).to_bytes(4, "little") + data)


def _report_error(where: str, exc: BaseException) -> None:
    _report(event="error", message=f"{where}: {type(exc).__name__}: {exc}"[:2000])


# ---------------------------------------------------------------------------------- the program


def _exec_program(cfg: dict[str, Any]) -> NoReturn:
    """In the forked program process: limits, identity, then exec. Never returns."""
    try:
        os.setpgid(0, 0)  # its own process group, so the supervisor can kill the group but not itself
        limits = cfg["rlimits"]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["as_bytes"], limits["as_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize_bytes"], limits["fsize_bytes"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
        # setuid/setgid bits and file capabilities are ignored from here on, in every descendant.
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.chdir(cfg["sandbox_dir"])
        os.umask(0o077)
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        os.execve(cfg["exe"], cfg["argv"], cfg["env"])
    except BaseException as exc:  # report, then die: the caller raises SandboxError from the event
        try:
            _report_error("starting the program", exc)
        finally:
            os._exit(126)


# ------------------------------------------------------------------------- the minimal root (init)


def _preserved_flags(path: str) -> int:
    """Mount flags of `path` that a remount must keep (required inside a user namespace)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if f & st:
            flags |= ms
    return flags


def _bind(source: str, target: str, *, readonly: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "a"):
            pass
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | _preserved_flags(target)
    if readonly:
        flags |= MS_RDONLY | MS_NODEV
    _mount(None, target, None, flags)


def _build_root(cfg: dict[str, Any]) -> None:
    """In init (pid 1, new mount namespace): build a minimal root and chroot into it.

    Visible: the system library dirs and the python prefix (read-only, nosuid), the program's
    work dir at /sandbox (read-write), fresh size-capped tmpfs /tmp and /dev/shm, five device
    nodes, and a /proc that shows only this pid namespace.
    """
    os.umask(0o022)
    root = cfg["root_mountpoint"]
    tmpfs_opts = f"size={cfg['tmpfs_mb']}m,nr_inodes=4096,mode=1777"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    bound = []
    for name in SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind(host, root + host, readonly=True)
            bound.append(host)
    for path in cfg["expose"]:
        if not any(path == b or path.startswith(b + "/") for b in bound):
            _bind(path, root + path, readonly=True)
            bound.append(path)
    _bind(cfg["workdir"], root + SANDBOX_DIR, readonly=False)
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_opts)
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for dev in DEVICES:
        _bind("/dev/" + dev, f"{root}/dev/{dev}", readonly=False)
    for name, dest in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(dest, f"{root}/dev/{name}")
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_opts)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/")


def _run_init(cfg: dict[str, Any], lifeline: int) -> NoReturn:
    """In the supervisor's only child. With the pid layer it is pid 1 of the new namespace."""
    try:
        signal.set_wakeup_fd(-1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The supervisor may have died before the prctl took effect; its end of the lifeline
        # pipe is then closed and the read end polls readable (EOF).
        if select.select([lifeline], [], [], 0)[0]:
            os._exit(0)
        if not cfg["pid"]:
            _exec_program(cfg)
        if cfg["mount"]:
            _build_root(cfg)
        program = os.fork()
        if program == 0:
            _exec_program(cfg)
        _detach_stdio()
        while True:  # reap every orphan (we are their init) until the program itself exits
            pid, status, usage = os.wait4(-1, 0)
            if pid == program:
                _report(event="program_exit", status=status, **_usage_fields(usage))
                # Returning kills the namespace: the kernel SIGKILLs everything left in it.
                os._exit(0)
    except BaseException as exc:
        try:
            _report_error("setting up the sandbox", exc)
        finally:
            os._exit(71)


# ------------------------------------------------------------------------------- the supervisor


def _usage_fields(usage: resource.struct_rusage) -> dict[str, float | int]:
    return {"utime": usage.ru_utime, "stime": usage.ru_stime, "maxrss": usage.ru_maxrss}


def _detach_stdio() -> None:
    """Drop our copies of the program's stdio so the caller sees EOF when the program's side closes."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _write_id_maps(uid: int, gid: int) -> None:
    """Map our own uid/gid to themselves in a fresh user namespace (the unprivileged path)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`, atomically with respect to fork (see module docstring)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
            code = 0
        except ProcessLookupError:
            code = 0  # no process of that uid exists: the goal is already met
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(f"could not kill the processes of uid {uid} (helper status {status})")


def _signal(pid: int, signum: int, *, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except ProcessLookupError:
        return  # already gone (or, for a group, not yet formed): the goal is met or the sweep covers it


def _children_of(parent: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we were scanning
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == parent:
            kids.append(int(entry))
    return kids


def _reap_everything() -> None:
    """Kill and reap every process re-parented to us (we are a child subreaper) until none is left."""
    me = os.getpid()
    while True:
        for pid in _children_of(me):
            _signal(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return  # no children left at all
        time.sleep(0.002)


def _kill_sandbox(cfg: dict[str, Any], child: int, ns_alive: bool) -> None:
    """SIGKILL the program and everything it started. `child` is init (pid layer) or the program."""
    if cfg["uid_unique"] and (ns_alive or not cfg["pid"]):
        try:
            kill_uid(cfg["uid"])
        except OSError:
            # Our helper forks into the pid namespace; that fails once its init has died, and
            # then everything in it is dead already. Without the pid layer it is a real failure.
            if not cfg["pid"]:
                raise
    if cfg["pid"] and not cfg["uid_unique"]:
        _signal(child, signal.SIGKILL)  # pid 1 dies and takes the namespace with it
    elif not cfg["pid"]:
        _signal(child, signal.SIGKILL, group=True)
        _signal(child, signal.SIGKILL)


def _wait(cfg: dict[str, Any], child: int, wake_r: int, deadline: float) -> tuple[int, Any, str | None]:
    """Wait for `child` until the wall deadline or a kill request (SIGUSR1: output cap, SIGTERM: cancel)."""
    try:
        pidfd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None  # kernel < 5.3: fall back to polling every 10 ms
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    reason: str | None = None
    killed_at = 0.0
    while True:
        pid, status, usage = os.wait4(child, os.WNOHANG)
        if pid == child:
            if pidfd is not None:
                os.close(pidfd)
            return status, usage, reason
        now = time.monotonic()
        if reason is None and now >= deadline:
            reason = "wall_timeout"
        if reason is not None and not killed_at:
            _kill_sandbox(cfg, child, ns_alive=True)
            killed_at = now
        elif killed_at and now - killed_at > 1.0:
            _signal(child, signal.SIGKILL)  # init did not exit after its program died: end it
        timeout = (deadline - now) if reason is None else 0.05
        if pidfd is None:
            timeout = min(timeout, 0.01)
        for fd, _ in poller.poll(max(timeout, 0.0) * 1000):
            if fd == wake_r:
                for signum in os.read(wake_r, 64):
                    if reason is None:
                        reason = "output_limit" if signum == signal.SIGUSR1 else "cancelled"


def supervise(cfg: dict[str, Any]) -> int:
    deadline = time.monotonic() + cfg["wall_s"]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    flags = (
        (CLONE_NEWUSER if cfg["userns"] else 0)
        | (CLONE_NEWNET if cfg["net"] else 0)
        | (CLONE_NEWPID if cfg["pid"] else 0)
        | (CLONE_NEWNS if cfg["mount"] else 0)
    )
    if flags:
        uid, gid = os.getuid(), os.getgid()
        _check(_libc.unshare(flags), f"unshare({flags:#x})")
        if cfg["userns"]:
            _write_id_maps(uid, gid)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)  # the wakeup fd carries the signal to _wait
    lifeline_r, lifeline_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(lifeline_w)
        _run_init(cfg, lifeline_r)
    os.close(lifeline_r)
    _detach_stdio()
    status, usage, reason = _wait(cfg, child, wake_r, deadline)
    if not cfg["pid"] and cfg["uid_unique"]:
        kill_uid(cfg["uid"])  # anything that left the program's process group
    _reap_everything()
    _report(event="result", status=status, reason=reason, **_usage_fields(usage))
    return 0


def main(argv: list[str]) -> int:
    global _report_fd
    if argv[1:2] == ["--kill-uid"]:
        kill_uid(int(argv[2]))
        return 0
    cfg = marshal.loads(bytes.fromhex(argv[1]))
    _report_fd = cfg["report_fd"]
    os.set_inheritable(_report_fd, False)  # never reaches the program's exec
    try:
        return supervise(cfg)
    except BaseException as exc:
        _report_error("supervisor", exc)
        return 70


if __name__ == "__main__":
    sys.exit(main(sys.argv))
