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
(its layers' `keys`/`values`, which decode steps extend in place: `_append`). Logits agree with
`model(...)` to float rounding (tested per architecture).

It runs decoders whose layers are exactly pre-norm attention + gated MLP with RMSNorm and rotary
positions: llama, mistral, qwen2 and qwen3 (with its per-head q/k norms), under the sdpa kernel,
with plain `nn.Linear` projections (not LoRA-wrapped or quantised) and no sliding window in
play. Anything else gets None and the engine calls the model itself.

The mask: a query sees the real keys up to its own column, and always itself, so a left-padding
query attends to its own (finite) key and no softmax row is empty (no NaN reaches the cache).

Prompts of uneven length can prefill packed (`prefill_packed`): all of them in one row, each
attending to itself only, so the padding a left-padded batch computes is not computed; their
keys/values are then placed into the left-padded cache the decode steps continue
(`benchmarks/generation.py`'s 16 prompts of 3-11 tokens: 106 tokens computed instead of 176).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollout.models import cpu_matmul
from rollout.models.arch import forward_cost, module_tree, sliding_window

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

MAX_PACKED_PREFILL = 1 << 24
"""Most (query, key) pairs of a packed prefill (its bool mask: 16 MiB)."""


def lean_decoder(
    model: Any, *, prepacked: bool = False, head: bool = True, invariant: bool = False, stacked: bool = False,
    fused_norms: bool = False,
) -> LeanDecoder | None:
    """The lean forward of `model` (a transformers causal LM), or None when it can't run it.
    `prepacked`: multiply by copies of the weights laid out for the CPU's products (see `LeanDecoder`).
    `stacked`, `fused_norms`: fewer kernel launches a layer, for an inference engine on a GPU (see
    `LeanDecoder`).
    `invariant`: every product on a fixed number of rows (`INVARIANT_ROWS`) and attention by the
    math kernel (`INVARIANT_ATTENTION`), so a row's results do not depend on how many rows share
    the pass.
    `head=False`: hidden states only (`lean_hidden_states`), so a model with another head than
    `lm_head` (a sequence classifier's `score`) runs too."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in ARCHITECTURES:
        return None
    if not type(model).__module__.startswith("transformers.models."):  # remote code: its own forward
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa" or sliding_window(config) is not None:
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or (head and not _is_linear(getattr(model, "lm_head", None))):
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
    return LeanDecoder(model, prepacked=prepacked, invariant=invariant, stacked=stacked, fused_norms=fused_norms)


def lean_hidden_states(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor
) -> torch.Tensor | None:
    """The last hidden states [rows, L, hidden] (after the final norm) of `model` (a transformers
    causal LM) on `ids` at `positions` under `attn_mask`, no cache -- what `model.model(input_ids=ids,
    attention_mask=attn_mask, position_ids=positions, use_cache=False).last_hidden_state` gives,
    the same bits forward and backward (tested), with less of transformers' per-call work around
    the same operations. `attn_mask`: a packed batch's 4D bool mask [rows, 1, L, L], or a padded
    batch's [rows, L] (1 = a real token; causal attention over the real keys, a padding query
    sees itself too: its output differs from transformers' there, where no loss reads it).
    `prefix`'s packed rows (training and frozen passes), SFT's batches and `sequence_logps` use it;
    `model` may be a sequence classifier too (the reward model's decoder). None where it can't stand in for that call: a model
    `lean_decoder` does not run, and any model whose forward does more than its math -- hooks on
    a module (forward, pre-forward or backward; also the global ones), a module whose `forward`
    was replaced (accelerate's offloading hooks), activation checkpointing, attention dropout in
    training mode."""
    modules = _modules_if_as_is(model)
    lean = _training_lean(model, modules) if modules is not None else None
    if lean is None:
        return None
    if attn_mask.dim() == 2:  # no padding at all: no mask, as transformers' sdpa path (`_layer`)
        attn_mask = None if bool(attn_mask.all()) else _attention_mask(attn_mask, attn_mask.shape[1])
    x, cos, sin = lean._embed(ids, positions)
    for layer in model.model.layers:
        x = lean._layer(layer, _as_given, x, cos, sin, attn_mask)
    return _rms_norm(model.model.norm, x)


def decoder_hidden_states(
    model: Any, decoder: Any, ids: torch.Tensor, attention_mask: torch.Tensor | None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decoder(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
    use_cache=False).last_hidden_state`, run through `lean_hidden_states` (the same bits) where it
    stands in for that call: `decoder` is `model.model` and the mask is one sdpa takes (a padded
    batch's [rows, L], a packed batch's 4D bool); elsewhere (LoRA layers, hooks, eager or flash
    attention, no mask) the decoder itself. No `positions`: 0.. along every row, as transformers."""
    if attention_mask is not None and getattr(model, "model", None) is decoder:
        at = positions if positions is not None else torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        hidden = lean_hidden_states(model, ids, at, attention_mask)
        if hidden is not None:
            return hidden
    return decoder(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=False).last_hidden_state


def _as_given(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def _modules_if_as_is(model: Any) -> tuple[torch.nn.Module, ...] | None:
    """`model`'s modules when calling them is nothing but their math (see `lean_hidden_states`),
    else None. A training step asks on every forward, so this reads the modules' own `__dict__`
    (their hook dicts, a patched `forward`, accelerate's `_hf_hook`, `gradient_checkpointing` as
    the instance or its class sets it) instead of going through `nn.Module.__getattr__`: ~23 us
    instead of ~150 us for the 59 modules of the tiny Qwen2."""
    from torch.nn.modules import module as nn_module

    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(nn_module, name, None):
            return None
    modules = module_tree(model)
    for m in modules:
        d = m.__dict__
        checkpointing = (d["gradient_checkpointing"] if "gradient_checkpointing" in d
                         else getattr(type(m), "gradient_checkpointing", False))
        if (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]
                or checkpointing or "forward" in d or "_hf_hook" in d):  # a patched forward (accelerate's offload)
            return None
    if model.training and float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0.0:
        return None
    return tuple(modules)


_LEAN_MODULES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, int | None], tuple[torch.nn.Module, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _training_lean(model: Any, modules: tuple[torch.nn.Module, ...]) -> LeanDecoder | None:
    """`lean_decoder(model, head=False)`. Its structural checks (~65 us on the tiny Qwen2, asked on
    every training forward) pass once per model and stand while its modules are the same objects
    (a LoRA layer, or any module swapped in, changes them) under the same attention kernel and
    window. The memo holds the modules below the root, so no id is reused while it stands, but
    not the root, its weak key: no module of transformers' own classes refers back to its model."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    kernel = (getattr(config, "_attn_implementation", None), sliding_window(config))
    if _LEAN_MODULES.get(model) == (kernel, modules[1:]):
        return LeanDecoder(model)
    lean = lean_decoder(model, head=False)
    if lean is not None:
        _LEAN_MODULES[model] = (kernel, modules[1:])
    return lean


class LeanDecoder:
    """`__call__(ids, mask, positions, cache)`: the model's logits at the last position.

    With `prepacked`, each projection multiplies by a copy of its weight made on first use
    (`prepack_weight`): in oneDNN's blocked layout (float32), else transposed to [in, out]. On the
    CPU, `F.linear` of a few rows repacks the [out, in] weight on every call, and at batch 16 that
    repacking costs more than the product; a transposed copy saves part of it and the blocked
    layout all of it (products of the ~48M model's shapes at 16 rows, weights read from memory, one
    thread: ~1.4x faster than `F.linear`, ~1.3x faster than the transposed copy; see
    benchmarks/README.md). A layer's q/k/v projections get one copy with their weights stacked, and
    its gate/up projections another: 4 products a layer instead of 7, and the narrow k/v weights
    join the blocked layout (48M model, 16 rows, one thread: a decode step ~37 -> ~35 ms). The copies double the weights' memory and are only right while the
    weights are unchanged: `refresh()` drops them after every weight change (the engine calls it
    from `update_weights` and `share_parameters`, which a trainer sharing its parameters calls
    after each optimizer step). `set_prepacked` turns them on or off (`PREPACK_MIN_TOKENS`).

    With `invariant`, every product runs on exactly `INVARIANT_ROWS` rows of activations (no
    prepacked copies) and attention on `INVARIANT_ATTENTION`'s kernel: what the batch-invariant
    engine (`hf_engine.BATCH_INVARIANT_PAD`) needs.

    Two options cut the kernel launches of a step where each launch costs more than its work (a
    GPU decoding a small model: ~37 launches a layer, benchmarks/results/2026-12-04-h200.md), for
    an inference engine only (training keeps transformers' bits). `stacked`: the q/k/v and the
    gate/up projections each multiply by one copy of their weights stacked as they are ([out, in],
    `F.linear`; the other products by the weights themselves): 4 products a layer instead of 7,
    the same sums per output. The copies are dropped by `refresh()` like prepacked ones. Not with
    `prepacked`, which stacks those already. `fused_norms`: every RMSNorm is torch's `rms_norm`
    (one fused kernel on a GPU, where transformers' formula launches eight); it scales the float32
    normalised values by the weight before the one cast to the input's dtype, where transformers
    casts and then scales, so in bfloat16 a value may differ from transformers' by a rounding.
    Together, a bfloat16 Qwen2 decode step dispatches 25 computing operations a layer instead of 44
    (counted with a `TorchDispatchMode` on the CPU: 177 -> 102 for 4 layers and the head)."""

    def __init__(
        self, model: Any, *, prepacked: bool = False, invariant: bool = False, stacked: bool = False,
        fused_norms: bool = False,
    ) -> None:
        if prepacked and invariant:
            raise ValueError("a batch-invariant lean decoder multiplies by the weights as they are (no prepacked copies)")
        if stacked and (prepacked or invariant):
            raise ValueError("stacked weight copies are for a lean decoder without prepacked copies or fixed row counts")
        config = model.config
        self.model = model
        self.prepacked = prepacked
        self.invariant = invariant
        self.stacked = stacked
        self.fused_norms = fused_norms
        self._prepacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.groups = self.heads // self.kv_heads

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """ids, positions: [rows, t]; mask: [rows, cached + t] (1 = a real token; the new tokens are
        its last t columns); `cache` (a `DynamicCache` holding the first columns) gets the new
        keys/values. Returns the logits [rows, vocab] of the last position, in the model's dtype."""
        x, cos, sin = self._embed(ids, positions)
        attn_mask = _attention_mask(mask, ids.shape[1])
        with sdpa_kernel(INVARIANT_ATTENTION) if self.invariant else contextlib.nullcontext():
            for i, layer in enumerate(self.model.model.layers):
                cached = cache.layers[i]
                x = self._layer(layer, lambda k, v, c=cached: _append(c, k, v), x, cos, sin, attn_mask)
        return self._logits(x[:, -1])

    def packs(self, lengths: Sequence[int], width: int) -> bool:
        """Whether prompts of these lengths prefill cheaper packed (`prefill_packed`) than
        left-padded to `width` (`arch.forward_cost`): P·w tokens and P·w² pairs padded, S tokens
        and S² pairs packed (S = the prompts' total length); never past `MAX_PACKED_PREFILL` pairs."""
        total, rows = sum(lengths), len(lengths)
        if rows < 2 or total * total > MAX_PACKED_PREFILL:
            return False
        config = self.model.config
        return forward_cost(config, total, total * total) < forward_cost(config, rows * width, rows * width * width)

    def prefill_packed(self, prompts: Sequence[Sequence[int]], width: int, cache: Any) -> torch.Tensor:
        """Prefill the prompts as one packed row -- each attends to itself only, positions from 0,
        no padding computed -- and leave their keys/values in the empty `cache` left-padded to
        `width` columns (zeros at the padding, which every later mask hides): at the real columns
        what `__call__` on the left-padded prompts leaves there, to float rounding. Returns the
        logits [prompts, vocab] of each prompt's last token."""
        device = self.model.lm_head.weight.device
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)[None]
        positions = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)[None]
        segment = torch.repeat_interleave(torch.arange(len(prompts)), lengths).to(device)
        total = ids.shape[1]
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        attn_mask = (causal & (segment[:, None] == segment[None, :]))[None, None]
        columns = torch.cat([torch.arange(width - int(n), width) for n in lengths]).to(device)

        def place(kv: Any) -> Any:
            def store(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                shape = (len(prompts), k.shape[1], width, k.shape[3])
                keys, values = k.new_zeros(shape), v.new_zeros(shape)
                keys[segment, :, columns] = k[0].transpose(0, 1)
                values[segment, :, columns] = v[0].transpose(0, 1)
                kv.update(keys, values)
                return k, v  # the packed row attends to its own keys

            return store

        x, cos, sin = self._embed(ids, positions)
        for i, layer in enumerate(self.model.model.layers):
            x = self._layer(layer, place(cache.layers[i]), x, cos, sin, attn_mask)
        return self._logits(x[0, (lengths.cumsum(0) - 1).to(device)])

    def refresh(self) -> None:
        """Forget the prepacked weight copies (the weights changed); they are made again on use."""
        self._prepacked.clear()

    def set_prepacked(self, prepacked: bool) -> None:
        """Multiply by prepacked copies from now on, or by the weights as they are (copies dropped)."""
        self.prepacked = prepacked
        self._prepacked.clear()

    def _linear(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return _fixed_rows_linear(x, layer.weight, layer.bias)
        if not self.prepacked:
            return cpu_matmul.linear(x, layer.weight, layer.bias)
        return self._packed_product((layer,), x)

    def _linears(self, layers: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's product with `x`. Prepacked, one product with the layers' weights stacked
        (q/k/v, gate/up: one copy made once, fewer and wider products), split into views."""
        if self.invariant:
            return tuple(_fixed_rows_linear(x, layer.weight, layer.bias) for layer in layers)
        if not (self.prepacked or self.stacked):
            return tuple(cpu_matmul.linear(x, layer.weight, layer.bias) for layer in layers)
        return self._packed_product(layers, x).split([layer.out_features for layer in layers], dim=-1)

    def _packed_product(self, layers: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        key = tuple(id(layer) for layer in layers)
        packed = self._prepacked.get(key)
        if packed is None:
            packed = self._prepacked[key] = _pack_stacked(layers, prepack=self.prepacked)
        weight, bias = packed
        if self.stacked:
            return F.linear(x, weight, bias)
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        out = torch.matmul(x, weight)
        return out if bias is None else out + bias

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token embeddings and the rotary cos and signed sin (`_rotary`), with a head axis, at
        `positions`."""
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, positions)
        half = sin.shape[-1] // 2
        return x, cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(self.model.lm_head, self._norm(self.model.model.norm, hidden))

    def _norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        if self.fused_norms:
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        return _rms_norm(norm, x)

    def _layer(
        self, layer: Any, store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decoder layer; `store(k, v)` keeps the new keys/values and returns those to attend to.
        `attn_mask` None: an unpadded batch without a cache, which transformers runs unmasked
        (`is_causal`, `enable_gqa`): the same call, since the masked one with repeated keys/values
        gives the same forward but other gradient bits (the key/value projections' sums)."""
        rows, t, _ = x.shape
        attn, mlp = layer.self_attn, layer.mlp
        h = self._norm(layer.input_layernorm, x)
        shape = (rows, t, -1, self.head_dim)
        q, k, v = self._linears((attn.q_proj, attn.k_proj, attn.v_proj), h)
        q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        keys, values = store(k, v)
        if attn_mask is None:  # an unpadded batch, no cache: causal, grouped heads in the kernel, as transformers
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1, scale=attn.scaling,
                                                 enable_gqa=self.groups > 1)
        else:
            if self.groups > 1:
                if t == 1:  # the query heads of one kv head as a sequence of queries: no copy of the cache
                    q = q.reshape(rows, self.kv_heads, self.groups, self.head_dim)
                else:
                    keys, values = _repeat_kv(keys, self.groups), _repeat_kv(values, self.groups)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=attn.scaling)
        out = out.reshape(rows, self.heads, t, self.head_dim).transpose(1, 2).reshape(rows, t, -1)
        x = x + self._linear(attn.o_proj, out)
        h = self._norm(layer.post_attention_layernorm, x)
        gate, up = self._linears((mlp.gate_proj, mlp.up_proj), h)
        return x + self._linear(mlp.down_proj, mlp.act_fn(gate) * up)


KV_HEADROOM = 32
"""Fewest free columns a key/value buffer gets when `_append` (re)allocates it."""


def _append(layer: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer.update(k, v)` (a `DynamicLayer`) without copying the whole cache every step.

    `DynamicLayer.update` concatenates: each decode step copies every cached key and value, per
    layer, a cost that grows with the length (48M model, 16 rows x 128 tokens, one thread: 7.42 s
    with it, 6.61 s without; within the noise at 16-32 tokens). Here the
    layer's `keys`/`values` become views of the first columns of buffers with free columns after
    them, and a step writes only its own columns. Whatever replaces `keys`/`values` with other
    tensors (the engine's row selection, merges, `model(...)`) is still right: when they are not
    the views of the buffers any more, the next call copies them into new buffers once. Buffers
    grow by half their used length, at least `KV_HEADROOM` columns. The attention reads the views
    (strided, not copied): the same results, bit for bit."""
    if not getattr(layer, "is_initialized", False) or layer.keys is None or not layer.keys.numel():
        return layer.update(k, v)
    keys, values = layer.keys, layer.values
    rows, heads, n, dim = keys.shape
    t = k.shape[2]
    buffers = getattr(layer, "_lean_buffers", None)
    if buffers is None or not _views_of(keys, values, buffers) or n + t > buffers[0].shape[2]:
        capacity = n + t + max(KV_HEADROOM, (n + t) // 2)
        buffers = (keys.new_empty(rows, heads, capacity, dim), values.new_empty(rows, heads, capacity, dim))
        buffers[0][:, :, :n] = keys
        buffers[1][:, :, :n] = values
        layer._lean_buffers = buffers
    buffers[0][:, :, n : n + t] = k
    buffers[1][:, :, n : n + t] = v
    layer.keys, layer.values = buffers[0][:, :, : n + t], buffers[1][:, :, : n + t]
    return layer.keys, layer.values


def _views_of(keys: torch.Tensor, values: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether keys/values are the leading columns of `buffers` (all rows, from column 0)."""
    return all(
        t.data_ptr() == b.data_ptr() and t.shape[0] == b.shape[0] and t.stride() == b.stride()
        and t.shape[1] == b.shape[1] and t.shape[3] == b.shape[3]
        for t, b in ((keys, buffers[0]), (values, buffers[1]))
    )


INVARIANT_ATTENTION = SDPBackend.MATH
"""The attention kernel of a batch-invariant `LeanDecoder`. The CPU flash kernel gave a row other
bits when the rows before it in its thread's share of the batch changed: an AMD EPYC with AVX2 at
two threads, decoding 4 rows alone or as the first 4 of 40, rows 0-1 equal and rows 2-3 (thread
1's first when alone) off in the last bits, while the same rows' queries, keys and values were
equal. The math kernel (products per row and head, softmax per row) gave the same bits both ways,
at ~10% more time for the tiny model's engine."""

INVARIANT_ROWS = (24, 96)
"""Activation rows per product of a batch-invariant `LeanDecoder`: a pass of one token a row (a
decode step, the logits), a pass of several (a prefill). CPU BLAS kernels choose their path, and so
the order they add in, by the row count: one thread, float32, a row's product was bitwise the same
for every count >= 4 on an AMD EPYC with AVX-512, but on an Intel Xeon with AVX-512 one path ran 2-5
or 2-15 rows (by the inner size) and another from 6 or 16, and with MKL's AVX2 kernels 4-48 rows
and from 64 others. A fixed count per call (the rows cut into chunks, the last filled with zeros)
gives one path. The count matters too: MKL's AVX2 kernels multiply rows in blocks of 6 and the last
2 rows of 8, 32 or 128 in another way, at two threads the last of each thread's share (16 and 64
rows split in two), while multiples of 12 -- 12, 24, 48, 96 -- kept every row on one path at one
and two threads; AVX-512 showed no such place (`tests/inference/test_lean_decoder.py` checks it).
The cost is the chunking, which Ray rollout workers and `[backend] batch_invariant` runs pay for
the guarantee: the 48M model's shapes (Intel Xeon, one thread, beside other work), a decode step's
products at 16 rows 1.1-1.6x the time of one `F.linear`, at 40 rows (two chunks) 1.6-2.3x, a
prefill of 16 x 64 tokens 1.2-1.6x. (MKL's strict reproducibility mode, `MKL_CBWR=AUTO,STRICT`,
makes its products row-count invariant for ~0-15% instead, but only if set before the process's
first product, and for every product of the process, the learner's too.)"""

PREPACK_MIN_TOKENS = 16
"""The fewest tokens per completion an RL trainer's rounds may run to for the engine to keep its
prepacked copies (`HFEngine.use_prepacked_weights`, `rl_common.plan_weight_copies`): the trainer
changes the weights after every round, so the copies are made again for every round, and a round
multiplies by each weight about once per token (per batch of rows). In isolation (hot cache) a copy
costs what ~1-14 products of 16 rows with it save over `F.linear` (21 for one row; the tiny and
the 48M model's shapes, one and two threads); in a GRPO loop they lost: the tiny model, 16 rows x
<= 8 tokens (`grpo_step.py`, 2 threads, interleaved pairs): 0.0343 s/step with copies, 0.0269
without (generation 0.0139 -> 0.0099 s; 8 pairs), and 0.0407 / 0.0358 in a slower hour (6 pairs;
copies into reused buffers 0.0397: not the allocation); one thread 0.0338 both."""

PACK_MIN_ELEMENTS = 1 << 18
"""The smallest weight (elements) `prepack_weight` gives oneDNN's layout. A oneDNN product costs
~35 us more per call than `mm` and packing ~0.27 ms per weight: on the tiny model's 128x512
weights `mm` on a transposed copy stays faster (one thread: 128->512 at 16 rows 21 vs 56 us, and
a GRPO step, which renews its weights every step, generated in 66 ms instead of 42); from the
48M model's 640x640 up the packed products win (at 16 rows 247 vs 344 us)."""

PACK_ROWS = 64
"""The row count oneDNN lays a packed weight out for: the products run fast for any count, but
packed for 1 row a 16-row product took 1.4x as long as packed for 16, 64 or 256 (48M model's
shapes, one thread)."""


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (a CPU tensor) laid out for products with a few rows of activations:
    oneDNN's blocked layout (an mkldnn tensor) for a float32 weight of `PACK_MIN_ELEMENTS` or
    more where torch has it, else a contiguous transposed copy [in, out]."""
    if weight.dtype == torch.float32 and weight.numel() >= PACK_MIN_ELEMENTS and _onednn_linear():
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    return weight.t().contiguous()


def _pack_stacked(layers: tuple[torch.nn.Linear, ...], *, prepack: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights stacked along their outputs (`prepack_weight`, or as they are [out, in]
    without `prepack`) and their biases (zeros where a layer has none; None when none has one)."""
    weight = torch.cat([layer.weight.detach() for layer in layers]) if len(layers) > 1 else layers[0].weight.detach()
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([
            layer.bias.detach() if layer.bias is not None
            else layer.weight.new_zeros(layer.out_features)
            for layer in layers
        ])
    return (prepack_weight(weight) if prepack else weight), bias


def _fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed `INVARIANT_ROWS` rows at a time (the last chunk filled
    with zeros), so each row's result is the same whatever rows it shares the call with."""
    rows = INVARIANT_ROWS[0] if x.dim() == 2 or x.shape[-2] == 1 else INVARIANT_ROWS[1]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n % rows:
        flat = torch.cat([flat, flat.new_zeros(rows - n % rows, flat.shape[1])])
    chunks = [F.linear(chunk, weight, bias) for chunk in flat.split(rows)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out[:n].view(*x.shape[:-1], out.shape[-1])


def _onednn_linear() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _attention_mask(mask: torch.Tensor, t: int) -> torch.Tensor:
    """[rows, 1, t, K] bool: query i (column K - t + i) sees the real keys up to its column, and itself."""
    width = mask.shape[1]
    real = mask.bool()
    if t == 1:
        return real[:, None, None, :]
    key = torch.arange(width, device=mask.device)
    query = key[width - t :, None]
    return ((real[:, None, :] & (key[None, :] <= query)[None]) | (key[None, :] == query)[None])[:, None]


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled. On the CPU, for float32
    (weight and input), torch's `rms_norm` runs the same operations in the same order -- the same
    bits -- with less dispatch (~5 us less per call on one thread); for other dtypes its rounding
    differs, and on CUDA it may be a fused kernel, so those take transformers' formula."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1], as
    `x * cos + [x2, x1] * [-sin1, sin2]` (`signed_sin`, made once per forward): negation is exact,
    so the same bits, in 4 operations instead of 7 (decode shapes, one thread: ~15 -> ~9 us)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


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
