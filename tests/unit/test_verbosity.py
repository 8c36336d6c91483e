"""`--log-level` / `ROLLOUT_LOG` (SPEC section 2): what `rollout.progress.set_log_level` lets through.

Each case runs in a fresh interpreter: the level is process-wide (the "rollout" logger, the
environment variable the CLI exports to the processes it starts).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollout.errors import ConfigError
from rollout.progress import LOG_LEVELS, set_log_level

SCRIPT = """
import logging, os, sys
from rollout.progress import TrainProgress, set_log_level, shows_progress
set_log_level(sys.argv[1])
log = logging.getLogger("rollout.check")
log.debug("a debug record")
log.info("an info record")
log.warning("a warning record")
with TrainProgress("sft", 2) as progress:
    progress.update(2, {"loss": 0.5})
print(os.environ["ROLLOUT_LOG"], shows_progress())
"""


def run(level: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LOG" and k != "RANK"}
    return subprocess.run([sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize(("level", "records", "progress"), [
    ("debug", ["DEBUG rollout.check: a debug record", "INFO rollout.check: an info record"], True),
    ("info", ["INFO rollout.check: an info record"], True),
    ("WARNING", [], False),
    ("error", [], False),
])
def test_each_level_lets_through_its_records_and_the_progress(level, records, progress):
    out = run(level)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    expected = records + (["WARNING rollout.check: a warning record"] if level.lower() != "error" else [])
    assert [line for line in lines if not line.startswith("step=")] == expected
    assert [line for line in lines if line.startswith("step=")] == (["step=2/2 loss=0.5"] if progress else [])
    assert out.stdout.split() == [level.lower(), str(progress)]


def test_an_unknown_level_names_where_it_came_from(monkeypatch):
    assert LOG_LEVELS == ("debug", "info", "warning", "error")
    with pytest.raises(ConfigError, match=r"^--log-level: 'loud' is not a log level \(use debug, info, warning, error\)$"):
        set_log_level("loud")
    monkeypatch.setenv("ROLLOUT_LOG", "verbose")
    with pytest.raises(ConfigError, match=r"^ROLLOUT_LOG: 'verbose' is not a log level"):
        set_log_level(None)
