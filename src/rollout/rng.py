"""Capture and restore every RNG a run touches (python, numpy, torch, cuda) as JSON.

Snapshots must never pickle, so generator states are turned into plain lists
and base64 strings.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    try:
        import torch

        state["torch"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        if torch.cuda.is_available():
            state["cuda"] = [
                base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
            ]
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        import torch

        raw = base64.b64decode(state["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
            )


@contextmanager
def rng_state_preserved() -> Iterator[None]:
    """Leave python's, numpy's and torch's global RNGs (cuda's too) as they were before the block,
    so work that may draw from them (an eval during training) can't change what training draws next."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
