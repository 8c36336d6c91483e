"""Isolation layers: which sets to try, strongest first, how to verify them, how to say what holds.

A layer set is what `_supervisor.py` is asked to set up for a run: `uid` (a unique
unprivileged uid, root only), `userns` (a user namespace, the unprivileged way to get the
others), `net`, `pid` and `mount` (namespaces; the mount layer is the minimal root and needs
the pid layer for its /proc). `local.LocalSandbox` probes the candidates in order and keeps
the first one under which `PROBE_CODE` reports facts that `check_probe_facts` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SANDBOX_UID_RANGE = range(0x7000_0000, 0x7000_0000 + 2**24)
"""Programs run as a random uid (and gid) from this range, unique among concurrent runs, when we are root.

High enough to miss login users, systemd's dynamic users (61184-65519) and the usual subuid
ranges of rootless containers (100000 + 65536 n for small n).
"""

SANDBOX_DIR = "/sandbox"  # the program's directory as it sees it under the mount layer
TMPFS_MB = 16  # size of the private /tmp and /dev/shm under the mount layer (host memory, so small)

PROBE_CODE = """
import json, os, socket
print(json.dumps({"uid": os.getuid(), "ppid": os.getppid(), "cwd": os.getcwd(),
                  "ifaces": sorted(n for _, n in socket.if_nameindex()), "root": sorted(os.listdir("/"))}))
"""


@dataclass(frozen=True)
class Layers:
    uid: bool = False
    userns: bool = False
    net: bool = False
    pid: bool = False
    mount: bool = False

    def name(self) -> str:
        on = [n for n in ("uid", "userns", "net", "pid", "mount") if getattr(self, n)]
        return "+".join(on) or "none"


def candidate_layers(*, is_root: bool, uid_ok: bool, namespaces_ok: bool, network: bool) -> list[Layers]:
    """Layer sets to probe, strongest first. Without root, namespaces need a user namespace."""
    if is_root:
        identities = ([Layers(uid=True)] if uid_ok else []) + [Layers()]
    else:
        identities = [Layers(userns=True), Layers()]
    ns_sets = [
        (True, True, True),
        (True, True, False),
        (True, False, False),
        (False, True, False),
        (False, False, False),
    ]
    ladder: list[Layers] = []
    for ident in identities:
        for net, pid, mount in ns_sets:
            c = replace(
                ident,
                net=net and namespaces_ok and not network,
                pid=pid and namespaces_ok,
                mount=mount and namespaces_ok,
            )
            if c.userns and not (namespaces_ok and (c.net or c.pid)):
                continue  # a user namespace on its own adds nothing
            if c.mount and is_root and not c.uid:
                continue  # root escapes a chroot at will: claiming a minimal root would be pretending
            if c not in ladder:
                ladder.append(c)
    return ladder


def uid_range_mapped() -> bool:
    """Is every uid/gid of SANDBOX_UID_RANGE mapped in our user namespace (containers may map fewer)?"""
    for name in ("uid_map", "gid_map"):
        try:
            lines = Path(f"/proc/self/{name}").read_text().splitlines()
        except OSError:
            return False
        extents = [tuple(int(x) for x in line.split()) for line in lines if line.strip()]
        if not any(
            inside <= SANDBOX_UID_RANGE.start and SANDBOX_UID_RANGE.stop <= inside + count
            for inside, _, count in extents
        ):
            return False
    return True


def check_probe_facts(layers: Layers, facts: dict[str, Any], *, uid: int | None) -> str | None:
    """None if what `PROBE_CODE` saw from inside matches every layer claimed, else what did not."""
    if layers.uid and facts["uid"] != uid:
        return f"program ran as uid {facts['uid']}, not {uid}"
    if layers.net and facts["ifaces"] != ["lo"]:
        return f"network interfaces visible: {facts['ifaces']}"
    if layers.pid and facts["ppid"] != 1:
        return f"program's parent is pid {facts['ppid']}, not the namespace's init"
    if layers.mount and (facts["cwd"] != SANDBOX_DIR or "etc" in facts["root"]):
        return f"minimal root not in effect (cwd {facts['cwd']}, / has {facts['root']})"
    return None


def describe_layers(layers: Layers, *, is_root: bool, network: bool, failures: list[str]) -> str:
    parts = []
    if layers.uid:
        parts.append(
            "runs as a unique unprivileged uid with no_new_privs (cannot signal or read/write root's"
            " or other users' non-public files; max_processes holds per sandbox)"
        )
    elif layers.userns:
        parts.append(
            "runs as the caller's uid inside a user namespace (can read and write whatever the caller"
            " can, where visible; max_processes counts all the caller's processes)"
        )
    else:
        who = "root (rlimits only; RLIMIT_NPROC does not bind root)" if is_root else "the caller's uid"
        parts.append(f"runs as {who}: NOT protected from the caller's files or processes")
    if layers.net:
        parts.append("own network namespace (no network, not even loopback)")
    elif network:
        parts.append("network allowed (limits.network=True)")
    else:
        parts.append("NOT network-isolated (no network namespace available)")
    if layers.pid:
        parts.append("own pid namespace (all its processes die with it)")
    else:
        parts.append(
            "no pid namespace: leftovers found by subreaper sweep"
            + (" and kill by uid" if layers.uid else "")
        )
    if layers.mount:
        parts.append(
            "minimal read-only root: system libraries and the python prefix, its dir at /sandbox,"
            f" private {TMPFS_MB} MiB /tmp"
        )
    else:
        parts.append("host filesystem visible (world-readable files can be read)")
    parts.append("rlimits cpu/as/nproc/nofile/fsize/core")
    note = "; ".join(parts)
    if failures:
        note += " [stronger sets unavailable: " + " | ".join(failures) + "]"
    return note
