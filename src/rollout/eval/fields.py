"""The fields every eval config shares: how an eval samples and scores, with one set of constraints.

`rollout eval`'s `[eval]` table (`EvalConfig`, `eval/config.py`) and a training run's `[eval]`
table (`PeriodicEvalConfig`, `rollout.config`) both declare these; each model gives its own
default:

    n: SamplesPerPrompt = 1
    success_threshold: SuccessThreshold = 1.0

Its own module because `rollout.config` imports it and `eval/config.py` imports
`rollout.config`. pydantic only (and the sidecar table, `rollout.sidecar_config`): no torch, nothing
from `rollout.config`.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, Field

from rollout.rl.builtins import BUILTIN_ENVS
from rollout.sidecar_config import SidecarConfig


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _non_empty(value: list[str]) -> list[str]:
    if any(not s for s in value):
        raise ValueError("stop strings must be non-empty")
    return value


EnvName = Annotated[
    Annotated[str, Field(min_length=1)] | SidecarConfig,
    Field(description=f"Env: {', '.join(BUILTIN_ENVS)}, an installed plugin, a 'module:attr' factory, or a"
                      ' sidecar table {kind = "sidecar", command = [...]}.'),
]


def env_label(env: str | SidecarConfig) -> str:
    """How records and messages name an env: its name, or "sidecar:env.py"."""
    return env if isinstance(env, str) else env.label


SamplesPerPrompt = Annotated[int, Field(ge=1, le=100_000, description="Samples per prompt.")]
Temperature = Annotated[float, Field(ge=0, le=100, description="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, Field(gt=0, le=1, description="Nucleus mass kept.")]
MaxTokens = Annotated[int, Field(ge=1, le=1_048_576, description="Most tokens per assistant turn.")]
StopStrings = Annotated[
    list[str], AfterValidator(_non_empty), Field(description="Stop strings (cut from the text).")
]
MaxTurns = Annotated[
    int, Field(ge=1, le=10_000, description="Most assistant turns per episode (multi-turn envs).")
]
EvalSeed = Annotated[
    int, Field(ge=0, le=2**63 - 1, description="Sample j of prompt i uses seed derive(seed, i, j).")
]
SuccessThreshold = Annotated[
    float, AfterValidator(_finite), Field(description="A sample succeeds when its reward is >= this.")
]
MaxBatchSize = Annotated[int, Field(ge=1, le=4096, description="hf: sequences decoded together.")]
