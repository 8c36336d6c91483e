"""Fixtures for the inference tests: one tiny random model and an engine over it.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/inference -q

Torch runs single-threaded here: the test machine has 2 shared cores, and an
oversubscribed OpenMP pool makes these tiny forward passes ~10x slower.
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
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("inference-model") / "tiny")


@pytest.fixture(scope="session")
def other_weights_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with different weights (same shapes): for weight updates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(123)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    out = tmp_path_factory.mktemp("inference-model") / "tiny-other"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path):
    """A shared hf engine; tests that change its weights must restore them."""
    from rollout.inference.hf_engine import load_hf_engine

    return load_hf_engine(tiny_model_dir, max_batch_size=8, model_name="tiny")
