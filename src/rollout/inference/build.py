"""From config to engine: the one place that reads `InferenceConfig` (components take plain arguments).

    resolved = resolve_engine_model(cfg, model="local/models/sft-tiny", storage_path=..., object_path=...)
    engine = build_engine(cfg, resolved)

Resolving comes first and loads nothing, so callers can check their inputs
against the model's identity before paying for a model load. Each engine
module is imported only once chosen: they bring torch, the openai client or
vLLM, and the CLI imports this module at start-up.
"""

from __future__ import annotations

from pathlib import Path

from rollout.errors import ConfigError
from rollout.inference.config import InferenceConfig
from rollout.inference.models import ResolvedModel, resolve_model
from rollout.inference.types import InferenceEngine


def resolve_engine_model(
    cfg: InferenceConfig, *, model: str | None, storage_path: Path, object_path: Path
) -> ResolvedModel:
    """What model the configured engine runs (`model` overrides `cfg.model`); snapshots are exported here."""
    spec = model or cfg.model
    if not spec:
        raise ConfigError("no model: pass --model or set inference.model")
    if cfg.engine == "openai":
        if not cfg.base_url and not cfg.base_urls:
            raise ConfigError('inference.base_url: required when engine = "openai" (or base_urls, for a pool)')
        where = cfg.base_url.rstrip("/") if cfg.base_url else ",".join(cfg.base_urls or ())
        return ResolvedModel(spec, spec, fixed_identity=f"openai:{where}:{spec}")
    return resolve_model(spec, storage_path=storage_path, object_path=object_path)


def build_engine(cfg: InferenceConfig, resolved: ResolvedModel) -> InferenceEngine:
    """The configured engine over a resolved model."""
    if cfg.engine == "openai" and cfg.base_urls:
        from rollout.inference.engine_pool import EnginePool
        from rollout.inference.openai_engine import OpenAIEngine

        servers = [
            OpenAIEngine(base_url=url, model_name=resolved.name, api_key=cfg.api_key, admin_key=cfg.admin_key,
                         max_concurrency=cfg.max_concurrency, timeout_s=cfg.request_timeout_s, max_retries=0)
            for url in cfg.base_urls
        ]
        return EnginePool(servers, names=cfg.base_urls, concurrency=cfg.max_concurrency,
                          max_attempts=cfg.request_attempts)
    if cfg.engine == "openai":
        from rollout.inference.openai_engine import OpenAIEngine

        assert cfg.base_url is not None  # checked by resolve_engine_model
        return OpenAIEngine(
            base_url=cfg.base_url,
            model_name=resolved.name,
            api_key=cfg.api_key,
            admin_key=cfg.admin_key,
            max_concurrency=cfg.max_concurrency,
            timeout_s=cfg.request_timeout_s,
        )
    if cfg.engine == "vllm":
        from rollout.inference.vllm_engine import load_vllm_engine

        return load_vllm_engine(
            resolved.path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            trust_remote_code=cfg.trust_remote_code,
            model_name=resolved.name,
        )
    import torch

    from rollout.inference.hf_engine import load_hf_engine

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return load_hf_engine(
        resolved.path,
        dtype=cfg.dtype,
        device=cfg.device,
        max_batch_size=cfg.max_batch_size,
        max_model_len=cfg.max_model_len,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
        model_name=resolved.name,
        kept_cache_bytes=cfg.kept_cache_mb << 20,
    )
