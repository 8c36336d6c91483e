"""Progress and verbosity: a rich progress bar on a TTY, plain lines on stderr otherwise, both
shown at log level `info` or more verbose (SPEC section 2).

    with TrainProgress("sft", total_steps, start=loop.step) as progress:
        ...
        progress.update(step, {"loss": 0.42, "tok/s": 5120})

    rollout --log-level warning train sft -c run.toml     # no progress: warnings and errors only
    ROLLOUT_LOG=debug rollout eval --config eval.toml      # progress, and rollout's debug records

The level, least to most verbose: `error`, `warning`, `info` (the default), `debug`. The CLI's
`--log-level` (or `ROLLOUT_LOG`) goes through `set_log_level`, which also sets `ROLLOUT_LOG` for
the process, so what it starts (torchrun ranks, sidecars, the local Ray cluster's workers)
prints as much; rollout's `logging` records (logger "rollout" and its children) go to stderr from
that level up. Library callers get the default unless they set `ROLLOUT_LOG` themselves.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from rollout.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_ENV = "ROLLOUT_LOG"


def log_level() -> str:
    """The level in force: `ROLLOUT_LOG` when it names one (`set_log_level` checked it), else `info`."""
    value = os.environ.get(LOG_ENV, "").strip().lower()
    return value if value in LOG_LEVELS else "info"


def shows_progress() -> bool:
    """Whether long operations show their progress (bars, plain lines): at `info` and `debug`."""
    return LOG_LEVELS.index(log_level()) <= LOG_LEVELS.index("info")


def set_log_level(value: str | None) -> None:
    """Apply `--log-level VALUE`, or `ROLLOUT_LOG` when VALUE is None (nothing set: `info`).
    A name outside `LOG_LEVELS` is a ConfigError (exit 2) naming where it came from."""
    import logging

    where = "--log-level"
    if value is None:
        where, value = LOG_ENV, os.environ.get(LOG_ENV, "info")
    name = value.strip().lower()
    if name not in LOG_LEVELS:
        raise ConfigError(f"{where}: {value!r} is not a log level (use {', '.join(LOG_LEVELS)})")
    os.environ[LOG_ENV] = name
    logger = logging.getLogger("rollout")
    logger.setLevel(name.upper())
    if not any(getattr(h, "rollout_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.rollout_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)  # the CLI's root logger has no handler: each record prints once


class TrainProgress:
    """A rich progress bar on a TTY; plain `key=value` lines on stderr otherwise."""

    def __init__(self, description: str, total: int, *, start: int = 0) -> None:
        self.description, self.total, self.start = description, total, start
        self.tty = sys.stderr.isatty()
        # under torchrun rank 0 shows the progress; nobody does above log level `info`
        self.quiet = os.environ.get("RANK", "0") != "0" or not shows_progress()
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
        return f"train {self.description}"

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


class ByteProgress:
    """How far a long transfer has got: a large file read (`verb="read"`: a dataset scan) or the
    snapshot uploads a run waits for at its end (`verb="upload"`). A rich bar on a TTY, else a plain
    `VERB=NAME mb=12/250` line on stderr every ~5%; shown only from `MIN_BYTES` (less moves in well
    under a second), at log level `info` or more verbose, and on torchrun's rank 0.

        with ByteProgress("read", "data/sft.jsonl", path.stat().st_size) as progress:
            for raw in f:
                progress.advance(len(raw))
    """

    MIN_BYTES = 64 << 20

    def __init__(self, verb: str, name: str, total_bytes: int) -> None:
        self.verb, self.name, self.total, self.done = verb, name, total_bytes, 0
        self.shown = total_bytes >= self.MIN_BYTES and shows_progress() and os.environ.get("RANK", "0") == "0"
        self._every = max(1, total_bytes // 20)
        self._next = self._every
        self._bar: Any = None

    def __enter__(self) -> ByteProgress:
        if self.shown and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"[bold]{self.verb} {{task.description}}"), BarColumn(), DownloadColumn(),
                TimeRemainingColumn(), console=Console(stderr=True), transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.name, total=self.total)
        return self

    def advance(self, nbytes: int) -> None:
        self.update(self.done + nbytes)

    def update(self, done: int) -> None:
        """`done` bytes of the total moved so far."""
        self.done = done
        if not self.shown or done < self._next:
            return
        self._next = done + self._every
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        else:
            print(f"{self.verb}={self.name} mb={done / 2**20:.0f}/{self.total / 2**20:.0f}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
