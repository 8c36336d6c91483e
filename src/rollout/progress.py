"""The training progress display: a rich progress bar on a TTY, plain lines on stderr otherwise.

    with TrainProgress("sft", total_steps, start=loop.step) as progress:
        ...
        progress.update(step, {"loss": 0.42, "tok/s": 5120})
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any


class TrainProgress:
    """A rich progress bar on a TTY; plain `key=value` lines on stderr otherwise."""

    def __init__(self, description: str, total: int, *, start: int = 0) -> None:
        self.total, self.start = total, start
        self.tty = sys.stderr.isatty()
        self.quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 shows the progress
        self.every = max(1, total // 20)
        self._bar: Any = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> TrainProgress:
        if self.tty and not self.quiet:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description_text, total=self.total, completed=self.start, info="")
        return self

    @property
    def description_text(self) -> str:
        return "train"

    def update(self, step: int, info: Mapping[str, float]) -> None:
        text = " ".join(f"{k}={_fmt(v)}" for k, v in info.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=text)
        elif not self.quiet and (step % self.every == 0 or step == self.total):
            print(f"step={step}/{self.total} {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
