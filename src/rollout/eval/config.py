"""The `[eval]` block: what to evaluate, on which env and data, and how to sample it.

    [eval]
    env = "arithmetic"                  # built-in env or "my_pkg.envs:ChessEnv"
    data = "data/arith/eval_prompts.jsonl"
    model = "models/sft-tiny"           # or snapshot = "3f2a9c1e", or base_url = "http://127.0.0.1:8000/v1"
    n = 8
    temperature = 1.0
    max_tokens = 32
    k = [1, 4, 8]

`rollout eval --config F` reads this table (and `[storage]` when present) and
every `rollout eval` flag overrides the field of the same name (`--top-p` sets
`top_p`). Relative paths resolve against the config file's folder. No torch here.

A training config's `[eval]` (`rollout.config.PeriodicEvalConfig`, run by
`eval/during_training.py`) shares the sampling fields (`eval/fields.py`); the model
it evaluates is the policy being trained, so it has no target fields.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from rollout.config import StorageConfig
from rollout.config_base import format_validation_errors
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

TARGET_FIELDS = ("model", "snapshot", "base_url")


class EvalConfig(BaseModel):
    """One eval: target, env, data, sampling, and how hard to retry a flaky endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    name: str | None = Field(None, max_length=200, description="Free-form label shown by `eval list`.")
    env: EnvName
    data: Path | None = Field(
        None,
        description='JSONL of prompt rows {"prompt", ...fields the env reads}; required unless the env'
        " has a default_data.",
    )
    model: str | None = Field(
        None, min_length=1, description="A Hugging Face model folder, run in-process (hf)."
    )
    snapshot: str | None = Field(
        None, pattern=r"^[0-9a-f]{8,64}$", description="A train_state snapshot id (or >= 8-hex prefix)."
    )
    base_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="An OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.",
    )
    served_model: str | None = Field(
        None, min_length=1, description="Model name at base_url; default: the first one it lists."
    )
    n: SamplesPerPrompt = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_tokens: MaxTokens = 256
    stop: StopStrings = Field(default_factory=list)
    max_turns: MaxTurns = 8
    seed: EvalSeed = 0
    success_threshold: SuccessThreshold = 1.0
    k: list[int] | None = Field(
        None, min_length=1, description="The k of pass@k / pass^k / maj@k / avg@k; default 1, 2, 4, ... <= n."
    )
    output: Path | None = Field(None, description="Also write one JSON line per sample here.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="hf: weights dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hf: where the model runs.")
    max_batch_size: MaxBatchSize = 32
    threads: int | None = Field(None, ge=1, le=1024, description="hf on CPU: torch intra-op threads.")
    max_concurrency: int = Field(16, ge=1, le=1024, description="Endpoint: requests in flight.")
    request_timeout_s: float = Field(120.0, gt=0, le=86_400, description="Endpoint: per-request timeout.")
    max_attempts: int = Field(4, ge=1, le=100, description="Tries per request before the sample is failed.")
    retry_backoff_s: float = Field(
        0.5, ge=0, le=600, description="Wait after the first failure; doubles after."
    )
    retry_max_backoff_s: float = Field(8.0, ge=0, le=3600, description="Longest wait between two tries.")

    @field_validator("data", "output")
    @classmethod
    def _resolve_path(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        base = (info.context or {}).get("base_dir")
        value = value.expanduser()
        if base is not None and not value.is_absolute():  # a config file's path: relative to its folder
            value = (Path(base) / value).resolve()
        return value

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        base = (info.context or {}).get("base_dir")
        path = Path(value).expanduser()
        if base is not None and not path.is_absolute():
            path = (Path(base) / path).resolve()
        return str(path)

    @field_validator("k")
    @classmethod
    def _positive_ks(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(k < 1 for k in value):
            raise ValueError("every k must be >= 1")
        return None if value is None else sorted(set(value))

    @model_validator(mode="after")
    def _one_target(self) -> EvalConfig:
        given = [name for name in TARGET_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            got = f"got {' and '.join(given)}" if given else "got none"
            raise ValueError(f"give exactly one of model, snapshot or base_url ({got})")
        if self.served_model is not None and self.base_url is None:
            raise ValueError("served_model needs base_url")
        if self.k is not None and max(self.k) > self.n:
            raise ValueError(f"every k must be <= n = {self.n} (got k = {max(self.k)})")
        return self

    @property
    def engine(self) -> Literal["hf", "openai"]:
        return "openai" if self.base_url is not None else "hf"

    def recorded_json(self) -> str:
        """The config as the store keeps it for `--resume` (it holds no secret: API keys are flags)."""
        return self.model_dump_json()


class _EvalFile(BaseModel):
    """The tables of a TOML file that `rollout eval` reads; the rest belongs to other loaders."""

    model_config = ConfigDict(extra="ignore")
    eval: EvalConfig


def read_eval_table(path: Path) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """(the `[eval]` table, the file's text, the `[storage]` table or None) of a TOML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config: {err}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    table = data.get("eval", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: eval: must be a table")
    storage = data.get("storage")
    return dict(table), text, storage if isinstance(storage, dict) else None


def build_eval_config(
    values: dict[str, Any], *, source: Path | None = None, text: str | None = None
) -> EvalConfig:
    """Validate `[eval]` values (relative paths against `source`'s folder); every problem located."""
    context = {"base_dir": source.parent.resolve()} if source is not None else None
    try:
        return _EvalFile.model_validate({"eval": values}, context=context).eval
    except ValidationError as err:
        messages = format_validation_errors(err, {"eval": values}, text=text, source=source)
        raise ConfigError(messages[0], details=messages[1:]) from None


def read_storage_config(path: Path) -> StorageConfig | None:
    """The `[storage]` table of a TOML file as a `StorageConfig` (paths against its folder), or None."""
    storage_file = create_model(
        "StorageFile", __config__=ConfigDict(extra="ignore"), storage=(StorageConfig | None, None)
    )
    path = Path(path)
    _, text, table = read_eval_table(path)
    if table is None:
        return None
    try:
        parsed = storage_file.model_validate({"storage": table}, context={"base_dir": path.parent.resolve()})
    except ValidationError as err:
        messages = format_validation_errors(err, {"storage": table}, text=text, source=path)
        raise ConfigError(messages[0], details=messages[1:]) from None
    return parsed.storage
