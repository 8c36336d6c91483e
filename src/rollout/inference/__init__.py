"""Inference: the engine protocol, the hf / openai / vllm engines, batch inference.

    from rollout.inference import SamplingParams, load_hf_engine
    engine = load_hf_engine("local/models/sft-tiny")
    completions = engine.generate(["What is 3+8?"], SamplingParams(temperature=0, max_tokens=8))

Importing this package is cheap (no torch); the engines load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.inference.types import (
    Completion,
    ContinuousEngine,
    DecodeSession,
    EngineUnavailable,
    FinishReason,
    GenerationError,
    GenerationRequest,
    InferenceEngine,
    LocalEngine,
    Message,
    Prompt,
    SamplingParams,
    TokenEvent,
)

if TYPE_CHECKING:
    from rollout.inference.hf_engine import HFEngine, load_hf_engine
    from rollout.inference.openai_engine import OpenAIEngine
    from rollout.inference.vllm_engine import VLLMEngine, load_vllm_engine

_LAZY = {
    "HFEngine": "rollout.inference.hf_engine",
    "load_hf_engine": "rollout.inference.hf_engine",
    "OpenAIEngine": "rollout.inference.openai_engine",
    "VLLMEngine": "rollout.inference.vllm_engine",
    "load_vllm_engine": "rollout.inference.vllm_engine",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollout.inference' has no attribute {name!r}")


__all__ = [
    "Completion",
    "ContinuousEngine",
    "DecodeSession",
    "EngineUnavailable",
    "FinishReason",
    "GenerationError",
    "GenerationRequest",
    "HFEngine",
    "InferenceEngine",
    "LocalEngine",
    "Message",
    "OpenAIEngine",
    "Prompt",
    "SamplingParams",
    "TokenEvent",
    "VLLMEngine",
    "load_hf_engine",
    "load_vllm_engine",
]
