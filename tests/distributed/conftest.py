"""The tiny model and small arithmetic data for the torchrun tests (helpers: dist_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import Inputs


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> Inputs:
    """The tiny model and 64 lines of arithmetic SFT and preference data."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("dist-inputs")
    model = init_tiny_model(root / "tiny")
    data = write_arithmetic_dataset(root / "arithmetic", num_train=64, num_eval=8)
    return Inputs(Path(model).resolve(), data["sft"].resolve(), data["pref"].resolve())
