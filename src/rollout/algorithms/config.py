"""The `[algorithm.<kind>]` blocks of a run config: one settings model per algorithm and the
blocks they share (model, optimizer, schedule, budget, dataset, packing, snapshots, LoRA, export).

    [algorithm]
    kind = "sft"
    [algorithm.sft]               # SFTConfig
    minibatch_size = 32
    [algorithm.sft.optimizer]     # AdamWConfig | SGDConfig, by kind
    kind = "adamw"
    lr = 3e-3

`rollout.algorithms.registry` maps each kind to its settings class here;
`rollout.config` builds the `[algorithm]` union and the whole `RunConfig`
from it. No torch here: `validate` and `train --dry-run` import this.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from rollout.config_base import ConfigPath, StrictModel, resolve_model_uri
from rollout.errors import ConfigError
from rollout.plugins import PluginKind, find_plugin, plugin_names
from rollout.rl.builtins import BUILTIN_ENVS, BUILTIN_REWARDS, BUILTIN_TOOLS
from rollout.sidecar_config import PluginRef, SidecarConfig

_PLUGIN_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class BaseModelConfig(StrictModel):
    """The model training starts from."""

    uri: Annotated[str, AfterValidator(resolve_model_uri)] = Field(
        min_length=1, description="Local model folder (relative to the config) or a hub id (online only)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    revision: str | None = Field(None, description="Hub revision (hub ids only).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off by default).")


class AdamWConfig(StrictModel):
    """AdamW (Loshchilov & Hutter, 2019)."""

    kind: Literal["adamw"]
    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="Adam (beta1, beta2)."
    )
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class SGDConfig(StrictModel):
    """Plain SGD with optional momentum."""

    kind: Literal["sgd"]
    lr: float = Field(gt=0, description="Peak learning rate.")
    momentum: float = Field(0.0, ge=0, lt=1, description="Momentum factor.")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay.")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0).")


OptimizerConfig = Annotated[AdamWConfig | SGDConfig, Field(discriminator="kind")]


class SchedulerConfig(StrictModel):
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

    kind: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of the peak.")


class BudgetConfig(StrictModel):
    """When training stops: exactly one of max_steps, max_epochs, max_tokens."""

    max_steps: int | None = Field(None, ge=1, description="Optimizer steps.")
    max_epochs: float | None = Field(None, gt=0, description="Passes over the dataset (fractions allowed).")
    max_tokens: int | None = Field(None, ge=1, description="Non-pad tokens seen.")

    @model_validator(mode="after")
    def _exactly_one(self) -> BudgetConfig:
        given = [n for n in ("max_steps", "max_epochs", "max_tokens") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of max_steps, max_epochs, max_tokens (got {len(given)})")
        return self


class JsonlDatasetConfig(StrictModel):
    """A local JSONL file, one object per line in any of TRL's dataset shapes (SPEC section 4)."""

    kind: Literal["jsonl_path"] = Field(
        "jsonl_path", description="jsonl_path | hf_dataset (files through `datasets`) | mixture (weighted)."
    )
    path: ConfigPath = Field(description="The JSONL file.")
    on_bad_line: Literal["error", "skip"] = Field(
        "error", description="error: refuse the file; skip: drop bad lines and report the count."
    )


class HFDatasetConfig(StrictModel):
    """One split read through the `datasets` library (the `data` extra), every row checked like a
    JSONL line: a parquet / arrow / JSON(L) / CSV file, a dataset folder (`save_to_disk`, or data
    files named by split), or a hub id when online (`rollout.data.hf`)."""

    kind: Literal["hf_dataset"]
    path: ConfigPath | None = Field(None, description="Local file or folder (relative to the config); or set name.")
    name: str | None = Field(None, min_length=1, description="Hub dataset id (online only); or set path.")
    split: str = Field("train", min_length=1, description="Split to read (a single file is split train).")
    columns: dict[str, Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict, description='Rename columns before the checks: {question = "prompt"}.'
    )
    streaming: bool = Field(False, description="Read row by row instead of building the `datasets` Arrow cache first.")
    on_bad_line: Literal["error", "skip"] = Field(
        "error", description="error: refuse the split; skip: drop bad rows and report the count."
    )

    @model_validator(mode="after")
    def _one_source(self) -> HFDatasetConfig:
        if (self.path is None) == (self.name is None):
            raise ValueError("set exactly one of path (local files) and name (a hub id)")
        return self


class JsonlMixtureSource(JsonlDatasetConfig):
    """A JSONL file in a mixture."""

    weight: float = Field(1.0, gt=0, description="Relative probability of drawing from this source.")


class HFMixtureSource(HFDatasetConfig):
    """A `datasets` split in a mixture."""

    weight: float = Field(1.0, gt=0, description="Relative probability of drawing from this source.")


def _dataset_kind(value: Any) -> str:
    """The `kind` of a dataset block; a block without one is a JSONL file (the default kind)."""
    kind = value.get("kind", "jsonl_path") if isinstance(value, dict) else getattr(value, "kind", "jsonl_path")
    return kind if isinstance(kind, str) else repr(kind)


MixtureSource = Annotated[
    Annotated[JsonlMixtureSource, Tag("jsonl_path")] | Annotated[HFMixtureSource, Tag("hf_dataset")],
    Discriminator(_dataset_kind),
]


class MixtureDatasetConfig(StrictModel):
    """A weighted mixture of datasets, interleaved once with its own seed, so a resumed run sees the
    same rows (`rollout.data.mixture`)."""

    kind: Literal["mixture"]
    sources: tuple[MixtureSource, ...] = Field(
        description="[[...dataset.sources]] blocks: a jsonl_path or hf_dataset each, with a weight."
    )
    seed: int = Field(0, ge=0, description="Seed of the interleave (the run's seed shuffles each epoch).")
    stop: Literal["first_exhausted", "all_exhausted"] = Field(
        "first_exhausted",
        description="first_exhausted: end when a source runs out; all_exhausted: repeat sources until all ran out.",
    )

    @model_validator(mode="after")
    def _has_sources(self) -> MixtureDatasetConfig:
        if not self.sources:  # checked here, not with min_length: that also fires when a source is invalid
            raise ValueError("a mixture needs at least one [[sources]] block")
        return self


DatasetConfig = Annotated[
    Annotated[JsonlDatasetConfig, Tag("jsonl_path")]
    | Annotated[HFDatasetConfig, Tag("hf_dataset")]
    | Annotated[MixtureDatasetConfig, Tag("mixture")],
    Discriminator(_dataset_kind),
]


class PackingConfig(StrictModel):
    """Sequence packing. Packed samples never attend to each other (block-diagonal mask)."""

    kind: Literal["off", "bfd", "wrapped"] = Field(
        "off", description="off: one sample per row; bfd: best-fit decreasing; wrapped: stream cut into rows."
    )
    max_seq_len: int = Field(512, ge=8, le=1_048_576, description="Row length; longer samples are truncated.")


class LossOnConfig(StrictModel):
    """Which tokens the SFT loss is computed on."""

    kind: Literal["full", "completion", "assistant"] = Field(
        "full", description="full: all; completion: the completion / last assistant turn; assistant: all assistant turns."
    )


class SnapshotConfig(StrictModel):
    """train_state snapshot cadence. One is always saved at the end of training."""

    every_steps: int | None = Field(None, ge=1, description="Save every N optimizer steps.")
    keep_last: int | None = Field(3, ge=1, description="Prune older unlabeled snapshots of the run (None keeps all).")


class LoraConfig(StrictModel):
    """LoRA adapters through peft (Hu et al., 2021)."""

    r: int = Field(8, ge=1, description="Rank.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1, description="Module names to adapt."
    )


class ExportConfig(StrictModel):
    """Write a Hugging Face–loadable model folder at the end of training."""

    dir: ConfigPath = Field(description="Output folder (overwritten).")


class TrainCommon(StrictModel):
    """What every algorithm block has: batch shape, model, optimizer, schedule, budget, data,
    snapshots, LoRA and export."""

    minibatch_size: int = Field(ge=1, le=65536, description="Rows per micro-batch.")
    gradient_accumulation: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm (None: no clipping).")
    base_model: BaseModelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    budget: BudgetConfig
    dataset: DatasetConfig
    packing: PackingConfig = Field(default_factory=PackingConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    export: ExportConfig | None = Field(None, description="Export the final model as a HF folder.")


class SFTConfig(TrainCommon):
    """Supervised fine-tuning: cross-entropy on the `loss_on` tokens."""

    loss_on: LossOnConfig = Field(default_factory=LossOnConfig)


class RMConfig(TrainCommon):
    """Reward model: Bradley–Terry scalar head on the last non-pad token."""

    head: Literal["bradley_terry"] = Field("bradley_terry", description="Reward head / loss.")
    margin: float = Field(
        0.0, description="Margin m in -log σ(r_c - r_r - m); a per-line `margin` field adds to it."
    )
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Adds c·mean((r_c + r_r)²) to keep rewards centred (Eisenstein et al., 2023)."
    )
    loss_on: LossOnConfig = Field(default_factory=LossOnConfig, description="Only `full`: RM scores whole sequences.")
    eval_dataset: DatasetConfig | None = Field(
        None,
        description="Held-out preference pairs: their pair accuracy is logged as eval/pair_accuracy"
        " at the end of training (the lines are read and checked before the first step).",
        exclude_if=lambda value: value is None,  # a config without it keeps the digest it always had
    )

    @model_validator(mode="after")
    def _rm_shape(self) -> RMConfig:
        if self.packing.kind != "off":
            raise ValueError('packing.kind must be "off" for rm (pairs are scored one per row)')
        if self.loss_on.kind != "full":
            raise ValueError('loss_on.kind must be "full" for rm (the reward scores the whole sequence)')
        return self


class ReferenceConfig(StrictModel):
    """The frozen reference policy of DPO/KTO.

    By default a frozen copy of the base model; under LoRA (and the same uri)
    the policy itself with its adapters disabled, so no second copy is held.
    With `precompute = true` its log-probs are computed once before training
    in a batched pass, stored content-addressed and reused by later runs on
    the same model and data; the reference is then never loaded in training.
    """

    uri: Annotated[str, AfterValidator(resolve_model_uri)] | None = Field(
        None, min_length=1, description="Reference model (default: base_model.uri)."
    )
    precompute: bool = Field(False, description="Compute reference log-probs once before training.")


def _pairs_unpacked(block: TrainCommon, kind: str) -> None:
    if block.packing.kind != "off":
        raise ValueError(f'packing.kind must be "off" for {kind} (sequences are scored one per row)')


class DPOConfig(TrainCommon):
    """Direct preference optimisation and its variants (sigmoid, ipo, hinge, robust)."""

    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL constraint.")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid", description="sigmoid: DPO; ipo: IPO (length-averaged log-probs); hinge: SLiC; robust: rDPO."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed label-flip rate ε (cDPO for sigmoid, rDPO for robust)."
    )
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)

    @model_validator(mode="after")
    def _dpo_shape(self) -> DPOConfig:
        _pairs_unpacked(self, "dpo")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"label_smoothing has no meaning for loss_type = {self.loss_type!r}")
        return self


class KTOConfig(TrainCommon):
    """Kahneman–Tversky optimisation on unpaired desirable/undesirable completions."""

    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL constraint.")
    desirable_weight: float = Field(1.0, gt=0, description="λ_D, weight of desirable examples.")
    undesirable_weight: float = Field(1.0, gt=0, description="λ_U, weight of undesirable examples.")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)

    @model_validator(mode="after")
    def _kto_shape(self) -> KTOConfig:
        _pairs_unpacked(self, "kto")
        if self.minibatch_size < 2:
            raise ValueError("minibatch_size must be >= 2 for kto (the KL estimate pairs mismatched lines)")
        return self


_PLUGIN_KIND: dict[str, PluginKind] = {"reward function": "reward", "env": "env", "tool": "tool"}


def _check_plugin_name(value: str, builtins: tuple[str, ...], what: str) -> str:
    """A built-in name, an installed plugin's name (`rollout.plugins`: metadata only, nothing is
    imported) or a 'module:attr' reference (imported at plan time by `check_plugins`)."""
    if _PLUGIN_REF.match(value):
        return value
    kind = _PLUGIN_KIND[what]
    try:
        if find_plugin(kind, value) is not None:
            return value
    except ConfigError as err:  # a name clash between two origins: one located error
        raise ValueError(str(err)) from None
    names = list(dict.fromkeys([*builtins, *plugin_names(kind)]))
    raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(names)} or 'module:attr'")


def _check_ref(value: str | SidecarConfig, builtins: tuple[str, ...], what: str) -> None:
    if isinstance(value, str):
        _check_plugin_name(value, builtins, what)


class RewardSpec(StrictModel):
    """One reward function: a built-in name or `module:attr`, with its weight in the sum."""

    kind: Literal["function"] = Field(
        "function", exclude=True,  # implied: a config without `kind` keeps the digest it always had
        description="function (the default) | reward_model (a trained RM scores completions).",
    )
    name: str = Field(description=f"Built-in ({', '.join(BUILTIN_REWARDS)}) or 'module:attr'.")
    weight: float = Field(1.0, description="Weight of this reward in the weighted sum (0: logged, not trained on).")

    @model_validator(mode="after")
    def _known(self) -> RewardSpec:
        _check_plugin_name(self.name, tuple(BUILTIN_REWARDS), "reward function")
        return self


_SNAPSHOT_ID = re.compile(r"^[0-9a-f]{8,64}$")


class RewardModelSpec(StrictModel):
    """A trained reward model (`rollout train rm`) as a reward: scored in process (`model` or
    `snapshot`: frozen, no grad, its own tokenizer and chat template, `rollout.rl.reward_model`) or
    by `rollout serve --model <RM export>` (`url`, `rollout.rl.served_reward`)."""

    kind: Literal["reward_model"]
    name: str = Field(
        "rm", pattern=r"^[A-Za-z_][\w.-]*$", max_length=64,
        description="Name of this reward (metric rollout/reward/<name>).",
    )
    model: ConfigPath | None = Field(None, description="RM export folder (relative to the config); or set snapshot.")
    snapshot: str | None = Field(
        None, description="A reward-model train_state snapshot id (or 8+ hex chars of it) in the run's store."
    )
    weight: float = Field(1.0, description="Weight of the (normalised) score in the weighted sum.")
    normalize: Literal["none", "group", "batch", "running"] = Field(
        "none",
        description="none: raw scores; group: minus the mean score of the same prompt's completions (a per-prompt"
        " baseline); batch: standardised over each scored batch; running: standardised by the mean/std of"
        " every score so far (kept in snapshots).",
    )
    batch_size: int = Field(32, ge=1, le=65536, description="Sequences per RM forward pass (with url: per request).")
    max_seq_len: int = Field(512, ge=2, le=1_048_576, description="Prompt + completion tokens kept (the first).")
    # a served RM; excluded from the dump when unset: a config without them keeps the digest it always had
    url: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048, exclude_if=lambda v: v is None,
        description='A served RM\'s base URL ("http://host:port/v1" of `rollout serve --model <RM export>`); or set'
        " model or snapshot.",
    )
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128, exclude_if=lambda v: v is None,
        description="With url: the environment variable holding the server's bearer key (never the key itself).",
    )
    request_timeout_s: float = Field(
        60.0, gt=0, le=3600, exclude_if=lambda v: v == 60.0, description="With url: seconds per request."
    )
    max_retries: int = Field(
        3, ge=0, le=20, exclude_if=lambda v: v == 3,
        description="With url: retries of a request that failed to connect, timed out or got 429/502/503/504.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardModelSpec:
        if sum(x is not None for x in (self.model, self.snapshot, self.url)) != 1:
            raise ValueError("set exactly one of model (an RM export folder), snapshot (an RM snapshot id) and url"
                             " (a served RM)")
        if self.url is None and (self.api_key_env is not None or "request_timeout_s" in self.model_fields_set
                                 or "max_retries" in self.model_fields_set):
            raise ValueError("api_key_env, request_timeout_s and max_retries go with url (a served RM)")
        if self.snapshot is not None and not _SNAPSHOT_ID.match(self.snapshot):
            raise ValueError(f"snapshot {self.snapshot!r} is not a snapshot id (8 to 64 lowercase hex characters)")
        problem = reward_model_dir_problem(self.model) if self.model is not None else None
        if problem is not None:
            raise ValueError(f"reward model {self.model}: {problem}")
        return self


def reward_model_dir_problem(path: Path) -> str | None:
    """Why `path` is not a reward-model folder (a 1-logit `...ForSequenceClassification`, as
    `rollout train rm` exports), or None. Reads config.json only: no torch."""
    if not path.is_dir():
        return "no such folder"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "not a model folder (no config.json)"
    except (OSError, ValueError) as err:
        return f"cannot read config.json: {err}"
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    architectures = config.get("architectures") or []
    labels = len(config.get("id2label") or {"0": ""})
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures) or labels != 1:
        return (f"not a reward model (architectures {architectures}, {labels} labels); export one with"
                " `rollout train rm` ([export] dir) or `rollout snapshot export <rm-snapshot-id>`")
    return None


def _reward_kind(value: Any) -> str:
    """The `kind` of a reward entry; an entry without one is a reward function (the default kind)."""
    kind = value.get("kind", "function") if isinstance(value, dict) else getattr(value, "kind", "function")
    return kind if isinstance(kind, str) else repr(kind)


class SidecarRewardSpec(SidecarConfig):
    """A sidecar's batched `reward.score` as a reward (`rollout.sidecar`, docs/sidecar-protocol.md);
    a failing sidecar drops the samples it was asked to score."""

    name: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.:-]*$", max_length=64,
        description="Name of this reward (metric rollout/reward/<name>; default: sidecar:<last command word>).",
    )
    weight: float = Field(1.0, description="Weight of this reward in the weighted sum.")

    @property
    def label(self) -> str:
        return self.name or super().label


RewardEntry = Annotated[
    Annotated[RewardSpec, Tag("function")]
    | Annotated[RewardModelSpec, Tag("reward_model")]
    | Annotated[SidecarRewardSpec, Tag("sidecar")],
    Discriminator(_reward_kind),
]


class EpisodeEnvConfig(StrictModel):
    """`[algorithm.<kind>.env]` as a table: multi-turn episodes (`rl/episode.py`), scored by the env.

    An `env = "name"` string keeps today's single-turn scoring (the env as a reward function).
    """

    name: PluginRef = Field(
        description=f"Env: {', '.join(BUILTIN_ENVS)}, an installed plugin, 'module:attr' (an env factory), or a"
        ' sidecar table {kind = "sidecar", command = [...]}.'
    )
    max_turns: int = Field(1, ge=1, le=256, description="Assistant turns per episode.")
    max_episode_tokens: int = Field(
        512, ge=1, le=1_048_576, description="Most tokens after the prompt (sampled + env + tool) per episode."
    )
    step_timeout_s: float = Field(30.0, gt=0, description="Per env reset / step; a timeout ends the episode (reward 0).")
    max_concurrent_steps: int = Field(32, ge=1, le=4096, description="Env steps running at once.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the env factory.")
    tools: tuple[PluginRef, ...] = Field(
        (),
        description=f"Tools handed to the env factory as `tools=`: {', '.join(BUILTIN_TOOLS)}, an installed plugin,"
        " 'module:attr', or a sidecar table (every tool its describe lists).",
    )

    @model_validator(mode="after")
    def _known(self) -> EpisodeEnvConfig:
        _check_ref(self.name, tuple(BUILTIN_ENVS), "env")
        for tool in self.tools:
            _check_ref(tool, tuple(BUILTIN_TOOLS), "tool")
        if self.tools and "tools" in self.options:
            raise ValueError("give tools in `tools`, not in `options`")
        if self.tools and isinstance(self.name, SidecarConfig):
            raise ValueError("a sidecar env lists its own tools in its describe answer: drop `tools`")
        if isinstance(self.name, SidecarConfig) and self.name.timeout_s >= self.step_timeout_s:
            raise ValueError(
                f"the sidecar's timeout_s ({self.name.timeout_s:g}) must be below step_timeout_s"
                f" ({self.step_timeout_s:g}), so that a hung sidecar is restarted"
            )
        return self


class RLCommon(TrainCommon):
    """Shared by GRPO and PPO: sampling, rewards, off-policy control.

    `minibatch_size` counts *prompts* per optimizer step; each prompt gets
    `num_generations` completions; `gradient_accumulation` splits the step's
    sequences into that many micro-batches.
    """

    num_generations: int = Field(8, ge=1, le=4096, description="Completions sampled per prompt (a group).")
    max_tokens: int = Field(16, ge=1, le=1_048_576, description="Most completion tokens per sample.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    rewards: tuple[RewardEntry, ...] = Field(
        (), description="Reward functions and reward models ([[rewards]] with kind), summed with their weights."
    )
    env: str | EpisodeEnvConfig | None = Field(
        None,
        description=f"Env scoring completions: {', '.join(BUILTIN_ENVS)} or 'module:attr'; a table"
        " ([algorithm.<kind>.env] with name, max_turns, ...) runs multi-turn episodes.",
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="Per reward-function call; failures drop samples.")
    num_iterations: int = Field(1, ge=1, le=64, description="Optimizer steps per generated batch.")
    off_policy_steps: Literal[0, 1] = Field(
        0, description="1: generate the next batch while training on this one (one-step off-policy)."
    )
    max_staleness: int = Field(1, ge=0, description="Drop carried samples more than this many versions old.")
    tis_cap: float | None = Field(
        2.0, gt=0, description="Truncated importance-sampling cap on π_old/π_rollout (None: no correction)."
    )
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)

    @model_validator(mode="after")
    def _sidecar_timeouts(self) -> RLCommon:
        for entry in self.rewards:
            if isinstance(entry, SidecarRewardSpec) and entry.timeout_s >= self.reward_timeout_s:
                raise ValueError(
                    f"reward {entry.label}: the sidecar's timeout_s ({entry.timeout_s:g}) must be below"
                    f" reward_timeout_s ({self.reward_timeout_s:g}), so that a hung sidecar is restarted"
                )
        return self

    @model_validator(mode="after")
    def _rl_shape(self) -> RLCommon:
        if not self.rewards and self.env is None:
            raise ValueError("set `env` or at least one [[rewards]] entry")
        names = [getattr(r, "label", r.name) for r in self.rewards]  # a sidecar's name may be implied
        if len(set(names)) != len(names):
            raise ValueError(f"[[rewards]] names must be unique (they name the metrics), got {names}")
        if isinstance(self.env, str):
            _check_plugin_name(self.env, tuple(BUILTIN_ENVS), "env")
        if isinstance(self.env, EpisodeEnvConfig) and self.rewards:
            raise ValueError(
                "[[rewards]] can't be combined with an [env] table: an episode's reward is the env's"
                " (use env = \"name\" to add an env to reward functions)"
            )
        if self.packing.kind != "off":
            raise ValueError('packing.kind must be "off" for RL (max_seq_len bounds prompt + completion)')
        if self.reference.precompute:
            raise ValueError("reference.precompute is for offline data; RL samples change every step")
        return self


class GRPOConfig(RLCommon):
    """Group relative policy optimisation and its variants (Dr. GRPO, DAPO, GSPO)."""

    beta: float = Field(0.0, ge=0, description="KL coefficient (k3) to the reference (0: no reference model).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's std, the batch's std, or nothing (Dr. GRPO)."
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio clip below: 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="Ratio clip above: 1 + clip_high (DAPO: 0.28).")
    loss_agg: Literal["token_mean", "seq_mean", "dr_grpo"] = Field("token_mean", description="Loss aggregation.")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token: GRPO; sequence: GSPO."
    )
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups that can't teach -- one reward for all (DAPO), one completion for all, fewer than 2"
        " scored -- and over-sample to refill.",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Train on no token of a completion cut short (max_tokens reached; an episode out of turns or"
        " tokens); it still counts in its group's advantages (TRL's mask_truncated_completions, DAPO's overlong"
        " filtering).",
    )
    max_oversample_rounds: int = Field(4, ge=1, description="Extra generation rounds to refill a filtered batch.")
    skip_zero_advantage: bool = Field(
        True,
        description="Leave out of the forward/backward the rows whose gradient is exactly zero -- an advantage of"
        " exactly 0 with beta = 0 (a group of equal rewards), no trained token -- keeping the step's normaliser, so"
        " the same gradient; the step's entropy, ratio and clip metrics then cover the rows trained"
        " (train/skipped_frac). One process only.",
    )

    @model_validator(mode="after")
    def _groups(self) -> GRPOConfig:
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2 for grpo (advantages are relative to the group)")
        return self


class PPOConfig(RLCommon):
    """PPO with a learned value head, GAE and a KL penalty folded into the reward."""

    num_generations: int = Field(1, ge=1, le=4096, description="Completions sampled per prompt.")
    clip_ratio: float = Field(0.2, gt=0, lt=1, description="Policy ratio clip.")
    clip_value: float = Field(0.2, gt=0, description="Value clip around the old values.")
    vf_coef: float = Field(0.1, ge=0, description="Value-loss coefficient.")
    value_lr: float | None = Field(
        None, gt=0,
        description="Peak learning rate of the value model (default: optimizer.lr). A critic that learns faster"
        " than the policy gives a per-prompt baseline sooner (verl's critic lr, OpenRLHF's critic_learning_rate).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    kl_coef: float = Field(0.05, ge=0, description="KL penalty folded into the per-token reward.")
    whiten_advantages: bool = Field(True, description="Normalise advantages over the batch.")

