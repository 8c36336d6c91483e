"""Every model rollout loads keeps transformers' own modules: no layers swapped for kernels fetched
from the hub (transformers 5.25 does that by default, and on CUDA an offline machine then cannot
load the model at all: "Version 2 of 'kernels-community/rotary' is not available in the local
cache", seen on a lent H200)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _hub_kernels_left_at_their_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)  # transformers' default: on


def _use_kernels(model: object) -> bool:
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "use_kernels"):
        pytest.skip("this transformers has no hub kernels")
    return bool(model.use_kernels)  # type: ignore[attr-defined]


@pytest.mark.parametrize("task", ["causal_lm", "reward"])
def test_trained_models_load_without_hub_kernels(tiny_model_dir: Path, task: str) -> None:
    from rollout.models.load import ModelSource, load_model

    model = load_model(ModelSource(str(tiny_model_dir)), task=task, pad_token_id=0, seed=0)
    assert _use_kernels(model) is False


def test_the_engine_loads_without_hub_kernels(tiny_model_dir: Path) -> None:
    from rollout.inference.hf_engine import load_hf_engine

    engine = load_hf_engine(tiny_model_dir)
    try:
        assert _use_kernels(engine.model) is False
    finally:
        engine.close()
