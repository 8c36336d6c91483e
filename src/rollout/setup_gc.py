"""Python's cyclic garbage collector while a training run sets up.

A 20-step `rollout train sft` of the tiny model took 8.3 s, 1.35 s of it in cyclic collections
before its first step: seven generation-2 collections, each scanning every object made so far while
imports (torch, transformers), model loading and tokenising grew the heap to ~430k objects
(benchmarks/README.md, twenty-eighth run); 6.75 s with the collector off. So a training run --
`rollout train`, or a recipe called from Python (`rollout.run.run_lifecycle` pauses too: a GRPO
benchmark calling `train_grpo` lost a 0.3-0.5 s generation-2 collection inside some of its 2-second
timed windows) -- pauses automatic collection (`paused_for_setup`) until its loop starts
(`setup_done`, from `rollout.run.restore_or_start`): one collection then, the survivors frozen
(`gc.freeze`: modules, model, data, kept for the whole run, are no longer rescanned) and the
collector back on. The pause's end unfreezes them, so that a process running several trainings
(a pipeline's stages, a test calling the CLI in-process) collects what each one left. vLLM freezes
its heap after start-up likewise; torchtitan and Megatron-LM turn automatic collection off for the
whole run. Nothing here changes a number a run computes: only when unreachable cycles are freed.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager

_state = {"paused": False, "frozen": False}


@contextmanager
def paused_for_setup(active: bool = True) -> Iterator[None]:
    """Automatic collection off until `setup_done` (or the block's end); on exit the collector as it
    was and anything `setup_done` froze unfrozen. A no-op when not `active`, or when the collector is
    already off (an enclosing pause, or a caller that manages it itself)."""
    if not active or not gc.isenabled():
        yield
        return
    gc.disable()
    _state["paused"] = True
    try:
        yield
    finally:
        _state["paused"] = False
        if _state["frozen"]:
            _state["frozen"] = False
            gc.unfreeze()
        gc.enable()


def setup_done() -> None:
    """The training loop starts: inside a pause, collect once, freeze what survived and turn automatic
    collection back on; elsewhere nothing."""
    if not _state["paused"] or gc.isenabled():
        return
    _state["paused"] = False
    gc.collect()
    gc.freeze()
    _state["frozen"] = True
    gc.enable()


_exit_freeze = {"registered": False}


def freeze_at_exit() -> None:
    """For a short command (`rollout validate`): at interpreter exit, freeze the heap before Python
    tears its modules down, so that the collections of that teardown skip what is frozen. They
    scanned every object the imports made (pydantic, typer: ~5% of `validate`'s instructions,
    `benchmarks/startup.py`) only to find module state that dies with the process anyway. What
    still runs at exit runs as before: atexit hooks (this one runs first: last registered), and so
    `weakref.finalize` callbacks (a sidecar's process group is still killed), the flush of stdout
    and stderr, deallocation by reference count. What it skips is the finalizers of cyclic garbage
    left at exit, which Python does not promise to run anyway, and which nothing of rollout's
    relies on (the stores commit as they go). Registered once per process, so a process that calls
    `validate` in-process (a test) freezes at its own exit too."""
    if not _exit_freeze["registered"]:
        _exit_freeze["registered"] = True
        atexit.register(gc.freeze)
