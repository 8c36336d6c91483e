"""Helpers the TRL benchmark scripts share (imported as a sibling module: the
scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from collections.abc import Iterator


def no_activation_checkpointing(config_cls: type) -> dict[str, bool]:
    """TRL configs turn gradient checkpointing on by default; transformers 5 renamed the flag."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {name: False for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Swallow stderr (progress bars/lines), but show it if the block fails."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise
