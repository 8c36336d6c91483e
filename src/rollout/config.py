"""The run config: pydantic models are the schema (SPEC section 3).

`load_config(path)` parses TOML, validates it against `RunConfig` and resolves
relative paths against the config file's folder. Every violation is reported
at once, each with a deterministic dotted locator
(`algorithm.sft.optimizer.lrr: unknown field`) and, where it can be found, the
line of the TOML file. `rollout schema` prints `RunConfig.model_json_schema()`;
`schema/run-config.schema.json` is a committed copy checked by the tests.

This module imports neither torch nor transformers: `rollout validate` and
`train --dry-run` must work without them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import blake3
from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    create_model,
    field_serializer,
    field_validator,
    model_validator,
)

from rollout.algorithms.config import TrainCommon, _check_plugin_name
from rollout.algorithms.registry import ALGORITHMS
from rollout.config_base import ConfigPath, StrictModel, format_validation_errors
from rollout.errors import ConfigError
from rollout.eval.fields import (
    EnvName,
    EvalSeed,
    MaxBatchSize,
    MaxTokens,
    MaxTurns,
    SamplesPerPrompt,
    StopStrings,
    SuccessThreshold,
    Temperature,
    TopP,
)
from rollout.inference.config import InferenceConfig
from rollout.rl.builtins import BUILTIN_ENVS
from rollout.sidecar_config import SidecarConfig

if TYPE_CHECKING:
    from rollout.store.objects import BucketUrl

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- storage


class EmbeddedStorageConfig(StrictModel):
    """The embedded metadata store: one SQLite file (WAL, synchronous=FULL)."""

    path: ConfigPath = Field(Path("./rollout.db"), description="SQLite database file.")


class PostgresStorageConfig(StrictModel):
    """PostgreSQL metadata store."""

    dsn: str = Field(min_length=1, description="postgresql://user@host:port/db")


def _parse_bucket_url(url: str) -> BucketUrl:
    """`rollout.store.objects.parse_bucket_url`, imported only for a bucket (`validate` of an fs
    config never loads the store package)."""
    from rollout.store.objects import parse_bucket_url

    return parse_bucket_url(url)


class ObjectStorageConfig(StrictModel):
    """Where snapshot bytes live: a content-addressed blob store, a local folder (`fs`) or a bucket
    (`s3`, `gcs`).

    Credentials come only from the provider's usual chain, never from this file:
    s3 from AWS's (`AWS_*` environment variables, `~/.aws` files, an instance
    role; the default region too), gcs from Google's (`GOOGLE_APPLICATION_CREDENTIALS`,
    gcloud's application-default login, the metadata server).
    """

    backend: Literal["fs", "s3", "gcs"] = Field(
        "fs", description="fs: a local folder (path); s3 / gcs: a bucket (url)."
    )
    path: ConfigPath = Field(
        Path("./object-store"),
        description="fs: the store's root folder. s3/gcs: the local staging folder a run writes snapshot blobs "
        "to before they are uploaded in the background.",
    )
    url: str | None = Field(
        None, description='s3: "s3://bucket/prefix"; gcs: "gs://bucket/prefix" (blobs at prefix/ab/cd/<blake3 digest>).'
    )
    endpoint_url: str | None = Field(
        None, description="s3/gcs: another endpoint (MinIO, an emulator), http(s)://host[:port]; default: the cloud's."
    )
    region: str | None = Field(
        None, pattern=r"^[a-z0-9-]+$", description="s3: the bucket's region; default: the AWS config chain."
    )
    max_attempts: int = Field(
        5, ge=1, le=20,
        description="s3: attempts per request (transient errors retried with exponential backoff); gcs: gcsfs's own 6.",
    )

    @field_validator("url")
    @classmethod
    def _url_names_a_bucket(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_bucket_url(value)  # its ValueError says what is wrong
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_http(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
            raise ValueError(f"must be an http:// or https:// URL (got {value!r})")
        return value

    @model_validator(mode="after")
    def _url_matches_backend(self) -> ObjectStorageConfig:
        if self.backend == "fs":
            extra = [name for name in ("url", "endpoint_url", "region") if getattr(self, name) is not None]
            if extra:
                raise ValueError(f'{", ".join(extra)}: only for backend = "s3" or "gcs" (fs uses path)')
        elif self.backend == "gcs" and self.region is not None:
            raise ValueError('region: only for backend = "s3" (a gcs bucket has its location)')
        elif self.url is None:
            scheme = "s3" if self.backend == "s3" else "gs"
            raise ValueError(f'backend = "{self.backend}" needs url = "{scheme}://bucket/prefix"')
        elif _parse_bucket_url(self.url).backend != self.backend:
            raise ValueError(f'url {self.url!r} does not match backend = "{self.backend}"')
        return self


class StorageConfig(StrictModel):
    """Where runs, events, metrics and snapshot rows (and bytes) are kept."""

    backend: Literal["embedded", "postgres"] = Field("embedded", description="Metadata store backend.")
    embedded: EmbeddedStorageConfig = Field(default_factory=EmbeddedStorageConfig)
    postgres: PostgresStorageConfig | None = None
    objects: ObjectStorageConfig = Field(default_factory=ObjectStorageConfig)
    runs_dir: ConfigPath | None = Field(
        None, description="Folder for per-run files (events.jsonl); default: `runs/` beside the database."
    )

    @model_validator(mode="after")
    def _postgres_needs_dsn(self) -> StorageConfig:
        if self.backend == "postgres" and self.postgres is None:
            raise ValueError('backend = "postgres" needs a [storage.postgres] block with dsn')
        return self

    def resolved_runs_dir(self) -> Path:
        return self.runs_dir if self.runs_dir is not None else self.embedded.path.parent / "runs"


# --------------------------------------------------------------------------- [algorithm]


class AlgorithmBlock(StrictModel):
    """`kind` selects the algorithm; its block `[algorithm.<kind>]` holds the settings."""

    kind: str

    @property
    def settings(self) -> TrainCommon:
        """The `[algorithm.<kind>]` block."""
        block: TrainCommon = getattr(self, self.kind)
        return block


def _algorithm_variant(kind: str, settings: type[TrainCommon]) -> type[AlgorithmBlock]:
    """`[algorithm]` for one kind: `kind = "<kind>"` and the required `[algorithm.<kind>]` block."""
    name = settings.__name__.removesuffix("Config") + "Algorithm"  # SFTConfig -> SFTAlgorithm
    variant: type[AlgorithmBlock] = create_model(
        name,
        __base__=AlgorithmBlock,
        __doc__=AlgorithmBlock.__doc__,
        kind=(Literal[kind], Field(description="Algorithm to run.")),
        **{kind: (settings, ...)},  # type: ignore[call-overload]
    )
    return variant


if TYPE_CHECKING:  # type checkers see the variants' common base
    AlgorithmConfig = AlgorithmBlock
else:  # pydantic sees the union, one model per registered kind, told apart by `kind`
    AlgorithmConfig = Annotated[
        Union[tuple(_algorithm_variant(spec.kind, spec.settings) for spec in ALGORITHMS.values())],  # noqa: UP007
        Field(discriminator="kind"),
    ]


class BackendConfig(StrictModel):
    """Training backend (SPEC section 7).

    `kind` is read at plan time (`validate`, `train`): every algorithm runs on
    `torch`; `fsdp` is FSDP2 over the ranks of a `[distributed]` process group
    (`torchrun`, or Ray with `num_learners` > 1; its `sharding` stays "fsdp"),
    the same training as `torch` there with the default sharding, named as a
    backend; `mock` (`rollout.backends.mock`, no torch) drives orchestration
    tests only, and `rollout train` refuses it with a located error.
    """

    kind: Literal["torch", "fsdp", "mock"] = Field(
        "torch",
        description="torch: real training (one device, or each rank under [distributed]); fsdp: FSDP2 over a"
        " [distributed] process group (torchrun, or ray with num_learners > 1); mock: no-torch stand-in.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when available.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (default: torch's).")
    cpu_matmul: Literal["torch", "onednn"] = Field(
        "torch",
        description="CPU float32 training products of the lean decoder and the LM head: torch's F.linear "
        "(MKL) or oneDNN's (forward and backward; the same math, other last bits). oneDNN was 1.3-1.6x "
        "faster per training step on an AMD EPYC CPU with AVX-512 at one thread and 0.8-0.9x on one "
        "without: measure on yours (benchmarks/cpu_linear.py). CUDA and bfloat16 products are F.linear "
        "either way.",
    )
    batch_invariant: bool = Field(
        False,
        description="GRPO/PPO on the in-process hf engine: sampled log-probs bitwise independent of the "
        "requests a batch holds (cache width kept a multiple of 16, each prompt prefilled on its own, "
        "matrix products on fixed row counts). "
        'Ray rollout workers always sample this way: set it on a `kind = "local"` run to get their '
        "numbers bit for bit. Off by default for now: it shifts GRPO/PPO results by float noise.",
    )


class LocalDistributedConfig(StrictModel):
    """`kind = "local"`: one process."""

    kind: Literal["local"] = Field("local", description="local: one process.")


class TorchrunDistributedConfig(StrictModel):
    """`kind = "torchrun"`: one learner process per device over torch.distributed (`rollout.distributed`).

    `rollout train` relaunches itself through `torch.distributed.run` with these settings (and
    works unchanged when `torchrun` starts it: the launcher's world size wins). Each global batch
    is split across the ranks, so the numbers match one process with the same settings; only
    rank 0 writes to the store and the object store; snapshots hold the full state, so a run
    resumes at any world size.
    """

    kind: Literal["torchrun"] = Field(description="torchrun: several processes, one per device.")
    nproc_per_node: int = Field(ge=1, le=1024, description="Processes (ranks) on each host.")
    nnodes: int = Field(1, ge=1, le=65536, description="Hosts taking part (the same config runs on each).")
    rdzv_endpoint: str | None = Field(
        None, min_length=1, max_length=300, pattern=r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$",
        description="host:port of the rendezvous (one of the hosts); required when nnodes > 1.",
    )
    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="fsdp: FSDP2 `fully_shard` (parameters, gradients and optimizer state sharded);"
        " ddp: DistributedDataParallel (each rank holds everything; LoRA runs only here).",
    )
    timeout_s: float = Field(
        1800.0, gt=0, le=86400, description="Collective timeout (a rank waiting longer on its peers fails)."
    )

    @model_validator(mode="after")
    def _rendezvous_for_several_hosts(self) -> TorchrunDistributedConfig:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of one of the hosts)")
        return self


class RayDistributedConfig(StrictModel):
    """`kind = "ray"`: a learner and rollout worker actors on a Ray cluster
    (`rollout.rl.ray_rollout`; GRPO and PPO). The learner is this process, or with
    `num_learners` > 1 a group of learner actors that train as torchrun's ranks do, over one
    torch.distributed process group (`rollout.rl.ray_learners`; GRPO and PPO).

    Each worker has its own engine, rewards and env, and takes leases of prompt groups from the
    learner's queue as it frees up (work stealing); a lease a worker does not return in time, or
    loses by dying, goes to another worker, and a group's result is taken once. Weights reach the
    workers through Ray's object store, versioned; sampling is seeded per group, so the numbers
    match `kind = "local"`.
    """

    kind: Literal["ray"] = Field(description="ray: rollout worker actors on a Ray cluster.")
    address: str = Field(
        "local", min_length=1, max_length=300,
        description='"local" starts a Ray instance in this process (stopped at the end); "auto" joins the'
        ' cluster on this host; "ray://host:port" joins a remote one.',
    )
    num_rollout_workers: int = Field(ge=1, le=4096, description="Rollout worker actors, each with its own engine.")
    num_cpus_per_worker: float = Field(1.0, ge=0, le=1024, description="CPUs Ray reserves for each worker.")
    num_gpus_per_worker: float = Field(
        0.0, ge=0, le=64, description="GPUs Ray reserves for each worker (> 0: its engine runs on cuda)."
    )
    max_groups_per_lease: int = Field(
        8, ge=1, le=4096,
        description="Most prompt groups one lease holds (leases shrink as the queue empties, so the last"
        " groups go one by one).",
    )
    lease_timeout_s: float = Field(
        600.0, gt=0, le=86400,
        description="A lease not returned in this long is given to another worker (the first result counts).",
    )
    num_learners: int = Field(
        1, ge=1, le=1024,
        description="Learner processes: 1 trains in this process; more start learner actors, one torch.distributed"
        " rank each (gloo on CPU, NCCL on CUDA), each training its slice of every micro-batch (GRPO; PPO with"
        ' sharding = "ddp").',
    )
    num_cpus_per_learner: float = Field(1.0, ge=0, le=1024, description="CPUs Ray reserves for each learner actor.")
    num_gpus_per_learner: float = Field(
        0.0, ge=0, le=64, description="GPUs Ray reserves for each learner actor (> 0: it trains on cuda)."
    )
    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="How learner actors share the model (num_learners > 1): fsdp (FSDP2 `fully_shard`) or ddp"
        " (DistributedDataParallel; LoRA runs only here).",
    )
    timeout_s: float = Field(
        1800.0, gt=0, le=86400, description="Learner actors' collective timeout (num_learners > 1)."
    )

    @field_validator("address")
    @classmethod
    def _known_address(cls, value: str) -> str:
        if value not in ("local", "auto") and not value.startswith("ray://"):
            raise ValueError('address is "local", "auto" or "ray://host:port"')
        return value


if TYPE_CHECKING:
    DistributedConfig = LocalDistributedConfig | TorchrunDistributedConfig | RayDistributedConfig
else:  # told apart by `kind`; a block without one is "local", as before there were kinds
    DistributedConfig = Annotated[
        Union[LocalDistributedConfig, TorchrunDistributedConfig, RayDistributedConfig],  # noqa: UP007
        Field(discriminator="kind", description="Scale-out: local (one process), torchrun or ray."),
    ]


class PeriodicEvalConfig(StrictModel):
    """`[eval]`: evaluate the policy being trained every `every_steps` optimizer steps and after
    the last one (`rollout.eval.during_training`), logging `eval/<metric>` at that step.

    The sampling fields are `rollout eval`'s (`rollout.eval.fields`); there is no model to name:
    it is the run's own. Every eval point samples with the same seeds, so two points differ only
    by the weights.
    """

    every_steps: int = Field(ge=1, description="Evaluate every N optimizer steps (and after the last step).")
    env: EnvName
    data: ConfigPath = Field(description='JSONL of prompt rows {"prompt", ...fields the env reads}.')
    max_prompts: int | None = Field(None, ge=1, description="Evaluate the first N rows only (None: every row).")
    n: SamplesPerPrompt = 4
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_tokens: MaxTokens = 256
    stop: StopStrings = Field(default_factory=list)
    max_turns: MaxTurns = 8
    seed: EvalSeed = 0
    success_threshold: SuccessThreshold = 1.0
    max_batch_size: MaxBatchSize = 32

    @field_validator("env")
    @classmethod
    def _known_env(cls, value: str | SidecarConfig) -> str | SidecarConfig:
        return value if isinstance(value, SidecarConfig) else _check_plugin_name(value, tuple(BUILTIN_ENVS), "env")


# --------------------------------------------------------------------------- [observe]

TRACKERS_EXTRA = "pip install 'rollout[trackers]'"


def _require_module(module: str) -> None:
    """Refuse a tracker whose client is not installed, at validate time (`find_spec` imports nothing)."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"the {module} package is not installed: {TRACKERS_EXTRA}")


class WandbConfig(StrictModel):
    """`[observe.wandb]`: a Weights & Biases run whose id is the rollout run id."""

    project: str = Field("rollout", min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, description="W&B team or user (default: the logged-in one).")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files under `dir` only (upload later with `wandb sync`); online: stream."
    )
    dir: ConfigPath | None = Field(None, description="Folder W&B writes its `wandb/` folder in; default: the run's folder.")


class MlflowConfig(StrictModel):
    """`[observe.mlflow]`: an MLflow run named after the rollout run id."""

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        description="http(s)://…, sqlite:///…, file:… or a folder (a file store); default: `mlruns/` in the runs folder.",
    )
    experiment: str = Field("rollout", min_length=1, max_length=500, description="Experiment (created if missing).")

    @field_validator("tracking_uri")
    @classmethod
    def _folder_to_file_uri(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A value without a scheme is a folder, resolved like every config path."""
        if value is None or ":" in value:
            return value
        path = Path(value).expanduser()
        base = (info.context or {}).get("base_dir")
        if base is not None and not path.is_absolute():
            path = Path(base) / path
        return path.resolve().as_uri()


class ObserveConfig(StrictModel):
    """`[observe]`: trackers that get every metric (at the store's step numbers) and the resolved
    config, besides the store and `events.jsonl` (`rollout.observe_trackers`). All off by default;
    each needs the `trackers` extra. A tracker that fails during a run is reported once on stderr
    and dropped: training goes on and the store still has everything."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files to `<run folder>/tensorboard/`.")
    wandb: WandbConfig | None = Field(None, description="Mirror to a Weights & Biases run.")
    mlflow: MlflowConfig | None = Field(None, description="Mirror to an MLflow run.")

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool) -> bool:
        if value:
            _require_module("tensorboard")
        return value

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: WandbConfig | None) -> WandbConfig | None:
        if value is not None:
            _require_module("wandb")
        return value

    @field_validator("mlflow")
    @classmethod
    def _mlflow_installed(cls, value: MlflowConfig | None) -> MlflowConfig | None:
        if value is not None:
            _require_module("mlflow")
        return value

    def enabled(self) -> bool:
        return self.tensorboard or self.wandb is not None or self.mlflow is not None


class RunConfig(StrictModel):
    """One training run."""

    schema_version: Literal[1] = Field(description="Config format version; must be 1.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seeds data order, init and sampling.")
    name: str | None = Field(None, max_length=200, description="Free-form run name.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    algorithm: AlgorithmConfig
    backend: BackendConfig = Field(default_factory=BackendConfig)
    distributed: DistributedConfig = Field(default_factory=LocalDistributedConfig)
    inference: InferenceConfig | None = Field(
        None, description="Generation engine and sampling (used by infer/serve, and by RL)."
    )
    eval: PeriodicEvalConfig | None = Field(
        None,
        description="Evaluate the policy during training (every algorithm whose model generates: not rm).",
        exclude_if=lambda value: value is None,  # a config without [eval] keeps the digest it always had
    )
    observe: ObserveConfig = Field(
        default_factory=ObserveConfig,
        description="Trackers (TensorBoard, W&B, MLflow) that mirror the run's metrics and config.",
        exclude_if=lambda value: not value.enabled(),  # a config without [observe] keeps the digest it always had
    )

    @field_validator("algorithm", mode="before")
    @classmethod
    def _one_block_for_kind(cls, value: Any) -> Any:
        """The kind's block is there and no other kind's is (in the user's words, before the union
        would report them as a missing and an unknown field)."""
        if not isinstance(value, Mapping) or value.get("kind") not in ALGORITHMS:
            return value  # the union reports a missing or unknown kind
        kind = value["kind"]
        if value.get(kind) is None:
            raise ValueError(f'kind = "{kind}" needs an [algorithm.{kind}] block')
        extra = [k for k in ALGORITHMS if k != kind and value.get(k) is not None]
        if extra:
            raise ValueError(f'[algorithm.{extra[0]}] does not match kind = "{kind}"')
        return {k: v for k, v in value.items() if k == kind or k not in ALGORITHMS}  # drop explicit None blocks

    @field_validator("distributed", mode="before")
    @classmethod
    def _local_by_default(cls, value: Any) -> Any:
        """`[distributed]` without `kind` is `local` (the only kind there was)."""
        return {**value, "kind": "local"} if isinstance(value, Mapping) and "kind" not in value else value

    @field_validator("eval")
    @classmethod
    def _policy_generates(cls, value: PeriodicEvalConfig | None, info: ValidationInfo) -> PeriodicEvalConfig | None:
        algorithm = info.data.get("algorithm")  # absent when [algorithm] itself is invalid
        if value is not None and algorithm is not None and not ALGORITHMS[algorithm.kind].generates:
            runs = ", ".join(k for k, spec in ALGORITHMS.items() if spec.generates)
            raise ValueError(
                f"{algorithm.kind} trains a model that does not generate text, so [eval] can't run on it"
                f" (it runs for {runs})"
            )
        return value

    @field_serializer("algorithm", mode="wrap")
    def _every_block_key(self, value: AlgorithmBlock, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`{"kind", "sft", "rm", ...}` with null for the other kinds: the shape (and so the digest)
        a run config has had since before the union."""
        data = handler(value)
        return {"kind": data["kind"], **{k: data.get(k) for k in ALGORITHMS}}

    def digest(self) -> str:
        """blake3 of the canonical JSON of the resolved config."""
        return blake3.blake3(self.canonical_json().encode()).hexdigest()

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------- loading + errors


def load_config(path: Path) -> RunConfig:
    """Read, parse and validate a TOML run config. Raises ConfigError with every violation."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config: {err}") from None
    return parse_config(text, source=path)


def parse_config(text: str, *, source: Path) -> RunConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None
    try:
        return RunConfig.model_validate(data, context={"base_dir": source.parent.resolve()})
    except ValidationError as err:
        messages = format_validation_errors(err, data, text=text, source=source)
        raise ConfigError(messages[0], details=messages[1:]) from None
