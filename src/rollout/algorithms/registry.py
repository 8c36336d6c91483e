"""The algorithms `rollout train` knows: kind -> settings class, data kind, train function.

    spec = ALGORITHMS["sft"]
    spec.settings                    # SFTConfig: the [algorithm.sft] block
    spec.data_kind                   # "sft": the line shape `validate` scans the dataset for
    train = spec.load_train()        # rollout.algorithms.sft:train_sft, imported only now
    result = train(cfg, resume=None) # -> TrainResult

This is the one list of algorithms. `rollout.config` builds the `[algorithm]`
discriminated union (and so the JSON Schema) from it; `cli/train.py` makes one
sub-command per entry; `validate` and `--dry-run` read `data_kind` and the
implemented backends from it. The train function is a "module:function"
string, so importing the registry imports no recipe and no torch.

Adding an algorithm: a settings class in `algorithms/config.py`, a recipe
module with `train_<kind>(cfg, *, resume=None) -> TrainResult`, one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rollout.algorithms.config import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    RMConfig,
    SFTConfig,
    TrainCommon,
)

DataKind = Literal["sft", "preference", "kto", "prompt"]


@dataclass(frozen=True)
class TrainResult:
    """What every train function returns."""

    run_id: str
    steps: int
    final_snapshot_id: str
    metrics: dict[str, float]


TrainFn = Callable[..., TrainResult]
"""`train(cfg: RunConfig, *, resume: str | None = None) -> TrainResult` (RunConfig is built from this
module, so the signature is spelled out here rather than typed)."""


@dataclass(frozen=True)
class AlgorithmSpec:
    kind: str
    """The name in `[algorithm] kind = ...`, in `[algorithm.<kind>]` and in `rollout train <kind>`."""
    settings: type[TrainCommon]
    """The pydantic model of the `[algorithm.<kind>]` block."""
    data_kind: DataKind
    """The shape every dataset line must have (`rollout.data.jsonl`)."""
    train: str
    """"module:function" of `train(cfg: RunConfig, *, resume: str | None = None) -> TrainResult`."""
    summary: str
    """One line for `rollout train --help`."""
    backends: tuple[str, ...] = ("torch",)
    """The `[backend] kind`s this algorithm runs on; another kind is refused before training."""
    distributed: tuple[str, ...] = ("local",)
    """The `[distributed] kind`s this algorithm runs under."""
    generates: bool = True
    """Its model samples text, so a run config's `[eval]` can evaluate it during training."""

    def load_train(self) -> TrainFn:
        """Import the recipe module and return its train function."""
        module, _, function = self.train.partition(":")
        train: TrainFn = getattr(importlib.import_module(module), function)
        return train


ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.kind: spec
    for spec in (
        AlgorithmSpec(
            "sft", SFTConfig, "sft", "rollout.algorithms.sft:train_sft", "Supervised fine-tuning.",
            distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "rm", RMConfig, "preference", "rollout.algorithms.rm:train_rm", "Bradley–Terry reward model.",
            generates=False, distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "dpo", DPOConfig, "preference", "rollout.algorithms.dpo:train_dpo",
            "Direct preference optimisation (loss_type sigmoid | ipo | hinge | robust).",
            distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "kto", KTOConfig, "kto", "rollout.algorithms.kto:train_kto",
            "Kahneman–Tversky optimisation on unpaired good/bad completions.",
        ),
        AlgorithmSpec(
            "grpo", GRPOConfig, "prompt", "rollout.algorithms.grpo:train_grpo",
            "Group relative policy optimisation against rewards / a verifiable env.",
        ),
        AlgorithmSpec(
            "ppo", PPOConfig, "prompt", "rollout.algorithms.ppo:train_ppo",
            "PPO with a value head, GAE and a KL penalty in the reward.",
        ),
    )
}
