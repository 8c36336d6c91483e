"""The `[inference]` block of a TOML config: which engine, how it loads, default sampling, server limits.

    [inference]
    engine = "hf"                 # hf | openai | vllm
    dtype = "float32"
    max_batch_size = 32
    [inference.sampling]          # defaults for `rollout infer batch` (flags override them)
    temperature = 0.7
    max_tokens = 256
    [inference.server]            # limits for `rollout serve`
    max_queue = 256

`load_inference_config(path)` reads only this table (other tables are left to
their own loaders) and reports every violation with the file, line and dotted
locator, like the run config (`inference.sampling.top_p: must be <= 1`).
No torch here. `RunConfig.inference` is this same model, so a run config may carry the block.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout.config_base import format_validation_errors
from rollout.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class SamplingConfig(_Strict):
    """Default sampling for batch inference; every field has a `rollout infer batch` flag."""

    temperature: float = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass kept (after top_k).")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 keeps all.")
    max_tokens: int = Field(256, ge=1, le=1_048_576, description="Most tokens generated per completion.")
    n: int = Field(1, ge=1, le=1024, description="Completions per prompt.")
    seed: int = Field(
        0, ge=0, description="Base seed; each sample's seed derives from it and the sample's id."
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings (cut from the text).")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra token ids that end a completion."
    )
    top_logprobs: int = Field(0, ge=0, le=20, description="Alternatives recorded per position.")
    ignore_eos: bool = Field(False, description="Generate past eos until max_tokens.")

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class ServerConfig(_Strict):
    """Limits of `rollout serve` (host, port and keys are flags)."""

    max_queue: int = Field(
        256, ge=1, description="Requests waiting for a batch slot; more get 503 + Retry-After."
    )
    gather_window_ms: float = Field(
        5.0, ge=0, le=1000, description="Wait this long for companions when idle."
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(16, ge=1, description="Largest n a request may ask for.")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one /v1/completions request.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After on 503.")


class InferenceConfig(_Strict):
    """Which engine generates, and how it is built."""

    engine: Literal["hf", "openai", "vllm"] = Field(
        "hf",
        description="hf: transformers in-process (CPU/GPU); "
        "openai: any OpenAI-compatible server; vllm: optional extra, GPU.",
    )
    model: str | None = Field(
        None,
        description="Model folder, snapshot id, or (openai) the served model name; `--model` overrides it.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype (hf, vllm)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hf: where the model runs.")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="hf: attention kernel.")
    max_batch_size: int = Field(32, ge=1, le=4096, description="Most sequences decoded together.")
    max_model_len: int | None = Field(None, ge=2, description="Context limit; default: the model's.")
    kept_cache_mb: int = Field(
        1024, ge=0, le=1 << 20,
        description="hf: memory (on the model's device) for the KV caches kept between the turns of"
        " multi-turn episodes, so a turn prefills only its new tokens; 0 keeps none.",
    )
    threads: int | None = Field(None, ge=1, le=1024, description="hf on CPU: torch intra-op threads.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model folder.")
    base_url: str | None = Field(None, description="openai: e.g. http://127.0.0.1:8000/v1")
    base_urls: list[str] | None = Field(
        None, min_length=1, max_length=1024,
        description="openai: several servers of the same model, load-balanced by pull (rollout.inference.engine_pool);"
        " instead of base_url.",
    )
    request_attempts: int = Field(
        3, ge=1, le=100,
        description="openai with base_urls: attempts per request across the servers (a server that does not answer"
        " rests, doubling, and its requests go to the others).",
    )
    api_key: str | None = Field(None, description="openai: bearer key (default $OPENAI_API_KEY or 'EMPTY').")
    admin_key: str | None = Field(None, description="openai: key for /update_weights_from_disk.")
    max_concurrency: int = Field(16, ge=1, le=4096, description="openai: requests in flight.")
    request_timeout_s: float = Field(600.0, gt=0, description="openai: per-request timeout.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vllm: share of GPU memory to use.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @field_validator("base_urls")
    @classmethod
    def _urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for url in value:
            if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
                raise ValueError(f"{url!r} is not an http(s) URL")
        stripped = [u.rstrip("/") for u in value]
        if len(set(stripped)) != len(stripped):
            raise ValueError("each server once: base_urls has a repeated URL")
        return stripped

    @model_validator(mode="after")
    def _one_endpoint_setting(self) -> InferenceConfig:
        if self.base_url is not None and self.base_urls is not None:
            raise ValueError("set base_url (one server) or base_urls (a pool), not both")
        return self


class _Root(BaseModel):
    """Just the `[inference]` table; the rest of the file belongs to other loaders."""

    model_config = ConfigDict(extra="ignore")
    inference: InferenceConfig = Field(default_factory=InferenceConfig)


def load_inference_config(path: Path | None) -> InferenceConfig:
    """The `[inference]` table of `path` (defaults when `path` is None or has no such table)."""
    if path is None:
        return InferenceConfig()
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
    try:
        cfg = _Root.model_validate(data).inference
    except ValidationError as err:
        messages = format_validation_errors(err, data, text=text, source=path)
        raise ConfigError(messages[0], details=messages[1:]) from None
    if cfg.model is not None and _looks_local(cfg.model):
        resolved = Path(cfg.model).expanduser()
        if not resolved.is_absolute():
            resolved = (path.parent / resolved).resolve()
        cfg = cfg.model_copy(update={"model": str(resolved)})
    return cfg


def _looks_local(model: str) -> bool:
    return model.startswith(("./", "../", "/", "~")) or model in (".", "..")


def with_overrides(cfg: InferenceConfig, **changes: object) -> InferenceConfig:
    """`cfg` with the given values (None = not given) applied and checked again.

    A dict value updates that sub-block: `with_overrides(cfg, sampling={"top_p": 0.9})`.
    """
    data = cfg.model_dump()
    for key, value in changes.items():
        if isinstance(value, dict):
            data[key].update({k: v for k, v in value.items() if v is not None})
        elif value is not None:
            data[key] = value
    try:
        return InferenceConfig.model_validate(data)
    except ValidationError as err:
        messages = [f"option {m}" for m in format_validation_errors(err, {"inference": data})]
        raise ConfigError(messages[0], details=messages[1:]) from None
