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
Or, from another package, an `AlgorithmSpec` registered as the entry point
`"algorithm.<kind>"` in the group `rollout.plugins` (`rollout.plugins`): it is
imported when this module loads (its settings class is part of the config
schema), so keep its module light. A plugin that can't be used (it fails to
import, isn't an `AlgorithmSpec`, or its kind clashes with another) is left
out or loses to the built-in, and its problem is in `ALGORITHM_PLUGIN_PROBLEMS`:
`rollout plugins list` shows it and `load_train` of that kind raises it.
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
from rollout.errors import ConfigError
from rollout.plugins import BUILTIN, clash_errors, plugins_of

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
        problem = ALGORITHM_PLUGIN_PROBLEMS.get(self.kind)
        if problem is not None:
            raise ConfigError(str(problem))
        module, _, function = self.train.partition(":")
        train: TrainFn = getattr(importlib.import_module(module), function)
        return train


BUILTIN_ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.kind: spec
    for spec in (
        AlgorithmSpec(
            "sft", SFTConfig, "sft", "rollout.algorithms.sft:train_sft", "Supervised fine-tuning.",
            backends=("torch", "fsdp"), distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "rm", RMConfig, "preference", "rollout.algorithms.rm:train_rm", "Bradley–Terry reward model.",
            generates=False, backends=("torch", "fsdp"), distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "dpo", DPOConfig, "preference", "rollout.algorithms.dpo:train_dpo",
            "Direct preference optimisation (loss_type sigmoid | ipo | hinge | robust).",
            backends=("torch", "fsdp"), distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "kto", KTOConfig, "kto", "rollout.algorithms.kto:train_kto",
            "Kahneman–Tversky optimisation on unpaired good/bad completions.",
            backends=("torch", "fsdp"), distributed=("local", "torchrun"),
        ),
        AlgorithmSpec(
            "grpo", GRPOConfig, "prompt", "rollout.algorithms.grpo:train_grpo",
            "Group relative policy optimisation against rewards / a verifiable env.",
            backends=("torch", "fsdp"), distributed=("local", "torchrun", "ray"),
        ),
        AlgorithmSpec(
            "ppo", PPOConfig, "prompt", "rollout.algorithms.ppo:train_ppo",
            "PPO with a value head, GAE and a KL penalty in the reward.",
            distributed=("local", "torchrun", "ray"),
        ),
    )
}


def _with_plugins(builtins: dict[str, AlgorithmSpec]) -> tuple[dict[str, AlgorithmSpec], dict[str, ConfigError]]:
    """The built-ins plus the algorithms installed packages register, and the problem of each
    kind a plugin could not be used for (a clash keeps the first: the built-in, else the first
    distribution by name)."""
    specs = dict(builtins)
    plugins = plugins_of("algorithm", {kind: spec.train for kind, spec in builtins.items()})
    problems = {name: err for (_, name), err in clash_errors(plugins).items()}
    for plugin in plugins:
        if plugin.origin == BUILTIN or plugin.name in specs:
            continue
        try:
            spec = plugin.load()
        except ConfigError as err:
            problems[plugin.name] = err
            continue
        if not (
            isinstance(spec, AlgorithmSpec) and spec.kind == plugin.name
            and isinstance(spec.settings, type) and issubclass(spec.settings, TrainCommon)
        ):
            problems[plugin.name] = ConfigError(
                f"algorithm plugin {plugin.name!r} from {plugin.where}: expected an AlgorithmSpec with kind"
                f" {plugin.name!r} and a TrainCommon settings class, got {type(spec).__name__}"
            )
            continue
        specs[plugin.name] = spec
    return specs, problems


ALGORITHMS, ALGORITHM_PLUGIN_PROBLEMS = _with_plugins(BUILTIN_ALGORITHMS)
"""Every algorithm `rollout train` knows, built-in then plugins; the problems of plugins, by kind."""
