"""A lean forward for the hf engine's prefill and decode steps of Llama-family decoders.

    step = lean_decoder(model)            # None where the model is not one it can run
    logits = step(ids, mask, positions, cache) if step else ...   # [rows, vocab], last position

`model(...)` in transformers does on every call what a decode step does not need: keyword
plumbing through several decorators, output capture, building the attention mask from the cache's
state, cache-class dispatch, output dataclasses. On a small model that is most of the step: the
tiny Qwen2 (1M parameters) at batch 16 decodes a token in ~3.3 ms through `model(...)` and in
~2.3 ms here, on one CPU thread (`benchmarks/generation.py`, `grpo_step.py`). The math is the
model's own, taken from its modules: the same parameter tensors (so weight pushes and
`share_parameters` apply unchanged), its rotary embedding module, RMSNorm computed as
transformers computes it (float32, then the input dtype), the same scaled-dot-product attention
with grouped-query heads packed (one query token) or repeated (a prefill) as transformers' sdpa
path does, and the key/value cache is the transformers `DynamicCache` the engine already keeps
(`layer.update`). Logits agree with `model(...)` to float rounding (tested per architecture).

It runs decoders whose layers are exactly pre-norm attention + gated MLP with RMSNorm and rotary
positions: llama, mistral, qwen2 and qwen3 (with its per-head q/k norms), under the sdpa kernel,
with plain `nn.Linear` projections (not LoRA-wrapped or quantised) and no sliding window in
play. Anything else gets None and the engine calls the model itself.

The mask: a query sees the real keys up to its own column, and always itself, so a left-padding
query attends to its own (finite) key and no softmax row is empty (no NaN reaches the cache).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def lean_decoder(model: Any) -> LeanDecoder | None:
    """The lean forward of `model` (a transformers causal LM), or None when it can't run it."""
    from rollout.models.prefix import sliding_window

    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in ARCHITECTURES:
        return None
    if not type(model).__module__.startswith("transformers.models."):  # remote code: its own forward
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa" or sliding_window(config) is not None:
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not _is_linear(getattr(model, "lm_head", None)):
        return None
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if not all(_is_linear(p) for p in projections) or not all(_is_rms_norm(n) for n in norms):
            return None
        if not callable(getattr(mlp, "act_fn", None)) or not hasattr(attn, "scaling"):
            return None
    if not _is_rms_norm(getattr(inner, "norm", None)) or getattr(inner, "rotary_emb", None) is None:
        return None
    return LeanDecoder(model)


class LeanDecoder:
    """`__call__(ids, mask, positions, cache)`: the model's logits at the last position."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.model = model
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.groups = self.heads // self.kv_heads

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """ids, positions: [rows, t]; mask: [rows, cached + t] (1 = a real token; the new tokens are
        its last t columns); `cache` (a `DynamicCache` holding the first columns) gets the new
        keys/values. Returns the logits [rows, vocab] of the last position, in the model's dtype."""
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attn_mask = _attention_mask(mask, ids.shape[1])
        for i, layer in enumerate(inner.layers):
            x = self._layer(layer, cache.layers[i], x, cos, sin, attn_mask)
        head = self.model.lm_head
        return F.linear(_rms_norm(inner.norm, x[:, -1]), head.weight, head.bias)

    def _layer(
        self, layer: Any, kv: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        rows, t, _ = x.shape
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(layer.input_layernorm, x)
        shape = (rows, t, -1, self.head_dim)
        q = _linear(attn.q_proj, h).view(shape)
        k = _linear(attn.k_proj, h).view(shape)
        v = _linear(attn.v_proj, h).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = kv.update(k, v)
        if self.groups > 1:
            if t == 1:  # the query heads of one kv head as a sequence of queries: no copy of the cache
                q = q.reshape(rows, self.kv_heads, self.groups, self.head_dim)
            else:
                keys, values = _repeat_kv(keys, self.groups), _repeat_kv(values, self.groups)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=attn.scaling)
        out = out.reshape(rows, self.heads, t, self.head_dim).transpose(1, 2).reshape(rows, t, -1)
        x = x + _linear(attn.o_proj, out)
        h = _rms_norm(layer.post_attention_layernorm, x)
        return x + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, h)) * _linear(mlp.up_proj, h))


def _attention_mask(mask: torch.Tensor, t: int) -> torch.Tensor:
    """[rows, 1, t, K] bool: query i (column K - t + i) sees the real keys up to its column, and itself."""
    width = mask.shape[1]
    real = mask.bool()
    if t == 1:
        return real[:, None, None, :]
    key = torch.arange(width, device=mask.device)
    query = key[width - t :, None]
    return ((real[:, None, :] & (key[None, :] <= query)[None]) | (key[None, :] == query)[None])[:, None]


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    rows, heads, length, dim = x.shape
    return x[:, :, None].expand(rows, heads, groups, length, dim).reshape(rows, heads * groups, length, dim)


def _is_linear(module: Any) -> bool:
    return type(module) is torch.nn.Linear


def _is_rms_norm(module: Any) -> bool:
    return (
        module is not None
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )
