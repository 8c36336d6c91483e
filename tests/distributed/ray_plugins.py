"""A reward function for the Ray tests (loaded through `module:attr` by the learner and the workers)."""

from __future__ import annotations

import os
import time
from pathlib import Path

KILL_FLAG_ENV = "ROLLOUT_TEST_KILL_FLAG"
CALLS = {"n": 0}


def length_or_kill(prompts, completions, **fields):
    """Longer text scores higher (a signal the untrained tiny model's samples vary on), except that
    rollout worker 1 `ray.kill`s itself on its 2nd call while the file named by
    $ROLLOUT_TEST_KILL_FLAG exists (the file is removed first: one kill per test)."""
    CALLS["n"] += 1
    flag = os.environ.get(KILL_FLAG_ENV)
    if os.environ.get("ROLLOUT_WORKER_ID") == "1" and CALLS["n"] >= 2 and flag and Path(flag).exists():
        import ray

        Path(flag).unlink()
        ray.kill(ray.get_runtime_context().current_actor)
        time.sleep(60)  # killed here, before this lease's groups are returned
    return [len(c) / 10 for c in completions]
