"""Fixtures for the RL harness tests: one tiny random model and an hf engine over it.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/rl -q

Torch runs single-threaded: the test machine has 2 shared cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def rl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("rl-model") / "tiny")


@pytest.fixture(scope="session")
def rl_engine(rl_model_dir: Path):
    from rollout.inference.hf_engine import load_hf_engine

    return load_hf_engine(rl_model_dir, max_batch_size=32, model_name="tiny")
