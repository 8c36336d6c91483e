"""Run a command with its stdout on a pseudo-terminal, as a person at a shell would (tables, not JSON).

from cli_terminal import run_in_terminal
text = run_in_terminal([rollout, "runs", "list"], cwd=root, env=env)
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_terminal(
    args: list[str], *, cwd: Path, env: dict[str, str], columns: int = 200, timeout: float = 120
) -> str:
    """The command's stdout as plain text (colours stripped, `\\r\\n` -> `\\n`); asserts it exits 0."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**env, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    process = subprocess.Popen(
        args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE
    )
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the command closed its end
                break
            if not data:
                break
            chunks.append(data)
        _, stderr = process.communicate(timeout=timeout)
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()
    text = _ANSI.sub("", b"".join(chunks).decode("utf-8")).replace("\r\n", "\n")
    assert process.returncode == 0, f"exit {process.returncode}\nstdout:\n{text}\nstderr:\n{stderr.decode()}"
    return text


def table_rows(text: str) -> list[list[str]]:
    """Non-empty lines split on runs of 2+ spaces (how rich pads cells), rules dropped."""
    rows = []
    for line in text.splitlines():
        cells = [cell for cell in re.split(r"\s{2,}", line.strip()) if cell]
        if cells and not set(line.strip()) <= {"─", " "}:
            rows.append(cells)
    return rows
