"""The hf engine's lean forward (`rollout.models.lean_decoder`) against transformers' own forward:
the same logits and cache for each architecture it runs, None for the models it does not, and the
same completions from the engine with it and without it."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.inference import SamplingParams
from rollout.inference.hf_engine import HFEngine, load_hf_engine
from rollout.inference.types import GenerationRequest
from rollout.models.lean_decoder import lean_decoder

SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, vocab_size=97, max_position_embeddings=128)


def _model(arch: str, *, heads: int = 4, kv_heads: int = 2, attn: str = "sdpa", **extra):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(**SMALL, num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)
    if arch == "mistral":
        config.sliding_window = None
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases: a missed term shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.3)
    return model


def _reference(model, ids, mask, positions, cache):
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


def _steps(model, forward):
    """Logits of a left-padded prefill, three decode steps, then a prefill of new tokens behind a
    hole of padding (the kept-cache layout: [pad, kept, pad, new]), each fed to `forward`; the
    cache and the final mask."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 2, 7]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 7 - n :] = torch.randint(3, 97, (n,), generator=gen)
        mask[i, 7 - n :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = []
    with torch.inference_mode():
        out.append(forward(model, ids, mask, positions, cache))
        pos = mask.sum(-1)
        for _ in range(3):
            token = torch.randint(3, 97, (3, 1), generator=gen)
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            out.append(forward(model, token, mask, pos[:, None], cache))
            pos = pos + 1
        # new tokens behind two pad columns (rows 0 and 2 two tokens, row 1 one: left-padded)
        new = torch.randint(3, 97, (3, 2), generator=gen)
        new_mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
        mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.long), new_mask], 1)
        new_pos = pos[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for layer in cache.layers:
                pad = torch.zeros(*layer.keys.shape[:2], 2, layer.keys.shape[-1])
                layer.keys, layer.values = torch.cat([layer.keys, pad], 2), torch.cat([layer.values, pad], 2)
        out.append(forward(model, new, mask, new_pos, cache))
    return out, cache, mask


@pytest.mark.parametrize("weights", ["as-is", "onednn", "transposed", "gpu-stacked"])
@pytest.mark.parametrize(
    "arch,heads,kv_heads",
    [("qwen2", 4, 2), ("qwen2", 4, 4), ("llama", 4, 1), ("mistral", 4, 2), ("qwen3", 4, 2)],
)
def test_logits_and_cache_match_the_model(arch, heads, kv_heads, weights, monkeypatch):
    from rollout.models import lean_decoder as lean_module

    if weights == "onednn":  # every weight in oneDNN's layout (only big ones are, unpatched)
        monkeypatch.setattr(lean_module, "PACK_MIN_ELEMENTS", 0)
    if weights == "transposed":  # small weights, or no oneDNN linear in torch: a transposed copy
        monkeypatch.setattr(lean_module, "_onednn_linear", lambda: False)
    model = _model(arch, heads=heads, kv_heads=kv_heads)
    if weights == "gpu-stacked":  # what the engine runs on a GPU, here on the CPU
        lean = lean_decoder(model, stacked=True, fused_norms=True)
    else:
        lean = lean_decoder(model, prepacked=weights != "as-is")
    assert lean is not None
    if weights in ("onednn", "transposed"):
        packed = lean_module.prepack_weight(model.lm_head.weight.detach())
        assert packed.is_mkldnn == (weights == "onednn")
    ours, our_cache, mask = _steps(model, lambda m, *a: lean(*a))
    theirs, their_cache, _ = _steps(model, _reference)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape == (3, 97)
        assert torch.allclose(a, b, atol=2e-5, rtol=0), (step, float((a - b).abs().max()))
    real = mask.bool()  # at padding columns the two differ (what a pad query attends to), unseen
    for mine, ref in zip(our_cache.layers, their_cache.layers, strict=True):
        for a, b in ((mine.keys, ref.keys), (mine.values, ref.values)):
            assert a.shape == b.shape
            assert torch.allclose(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=2e-5)


def test_decode_steps_write_into_the_cache_in_place_and_survive_a_row_selection():
    """A decode step writes its keys/values into free columns of the cache's buffers (no copy of
    the whole cache per step, as `DynamicLayer.update`'s concatenation makes); when the engine
    replaces the tensors (dropping a finished row), the next step copies them into new buffers once,
    and every step's logits stay transformers'."""
    from transformers import DynamicCache

    model = _model("qwen2")
    lean = lean_decoder(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (3, 4), generator=gen)
    mask = torch.ones(3, 4, dtype=torch.long)
    caches = {"lean": DynamicCache(config=model.config), "model": DynamicCache(config=model.config)}
    forwards = {"lean": lambda *a: lean(*a), "model": lambda *a: _reference(model, *a)}

    def step(ids, mask, positions):
        out = {k: forwards[k](ids, mask, positions, caches[k]) for k in caches}
        assert torch.allclose(out["lean"], out["model"], atol=2e-5, rtol=0)

    with torch.inference_mode():
        step(ids, mask, torch.arange(4).expand(3, 4))
        layer = caches["lean"].layers[0]
        pointers = []
        for t in range(4, 10):
            mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=torch.long)], 1)
            step(torch.randint(3, 97, (len(mask), 1), generator=gen), mask, torch.full((len(mask), 1), t))
            pointers.append(layer.keys.data_ptr())
            assert layer.keys.shape[2] == t + 1 and layer._lean_buffers[0].shape[2] > t + 1
        assert len(set(pointers[1:])) == 1  # after the first step's copy, every step writes in place
        keep = torch.tensor([0, 2])  # row 1 finished: the engine's row selection replaces the tensors
        for cache in caches.values():
            for cached in cache.layers:
                cached.keys, cached.values = cached.keys.index_select(0, keep), cached.values.index_select(0, keep)
        mask = mask[keep]
        for t in range(10, 13):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            step(torch.randint(3, 97, (2, 1), generator=gen), mask, torch.full((2, 1), t))
        assert layer.keys.shape == (2, 2, 13, 16) and layer._lean_buffers[0].shape[0] == 2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_packed_prefill_leaves_what_the_padded_one_does(arch):
    """Prompts of 5, 2 and 7 tokens in one packed row: the same last logits, the same keys/values
    at the real columns (zeros at the padding), and the next decode step on either cache agrees."""
    from transformers import DynamicCache

    model = _model(arch)
    lean = lean_decoder(model)
    gen = torch.Generator().manual_seed(2)
    prompts = [tuple(torch.randint(3, 97, (n,), generator=gen).tolist()) for n in (5, 2, 7)]
    width = 8
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    assert lean.packs([5, 2, 7], width) and not lean.packs([7, 7, 7], 7)  # no padding: nothing to save
    padded, packed = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.inference_mode():
        expected = lean(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), padded)
        got = lean.prefill_packed(prompts, width, packed)
        assert torch.allclose(got, expected, atol=2e-5, rtol=0)
        real = mask.bool()
        for a, b in zip(packed.layers, padded.layers, strict=True):
            assert a.keys.shape == b.keys.shape and a.keys.shape[:3] == (3, 2, width)
            assert torch.allclose(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real], atol=2e-5)
            assert torch.allclose(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real], atol=2e-5)
            assert not bool(a.keys.transpose(1, 2)[~real].any())
        token, step_mask = torch.tensor([[7], [8], [9]]), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        position = mask.sum(-1, keepdim=True)
        after_packed = lean(token, step_mask, position, packed)
        after_padded = lean(token, step_mask, position, padded)
    assert torch.allclose(after_packed, after_padded, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("llama", 1), ("qwen3", 2)])
def test_packed_rows_train_through_it_with_the_bits_of_the_model(arch, kv_heads, monkeypatch):
    """`prefix_logps` on packed rows runs the decoder lean (`lean_hidden_states`): log-probs,
    entropies and every parameter's gradient equal those of `model.model(...)` bit for bit."""
    from rollout.models import lean_decoder as lean_module
    from rollout.models import prefix
    from rollout.models.prefix import collate_prefix, prefix_logps

    model = _model(arch, kv_heads=kv_heads).train()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (6, 3)]
    rows = collate_prefix([prompts[i % 2] for i in range(6)],
                          [torch.randint(3, 97, (1 + i % 4,), generator=gen).tolist() for i in range(6)], 0)
    packed = prefix.packed_layout
    monkeypatch.setattr(prefix, "packed_layout", lambda b, c, d=torch.float32: packed(b, c, d, force=True))
    calls = []
    real = lean_module.lean_hidden_states

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    def run(lean):
        monkeypatch.setattr(lean_module, "lean_hidden_states", counted if lean else (lambda *a: None))
        model.zero_grad(set_to_none=True)
        logps, entropy = prefix_logps(model, rows, with_entropy=True)
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}

    lean, plain = run(True), run(False)
    assert calls == [True]
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    assert all(torch.equal(lean[2][n], plain[2][n]) for n in plain[2])
    assert any(g.abs().sum() > 0 for g in plain[2].values())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("llama", 1)])
def test_a_2d_mask_trains_through_it_with_the_bits_of_the_model(arch, kv_heads, padded):
    """A padded or unpadded batch's [rows, L] mask (SFT, `sequence_logps`, the RM): hidden states
    and every parameter's gradient equal `model.model(...)`'s bit for bit. Unpadded, transformers
    runs sdpa unmasked (`is_causal`, grouped heads in the kernel): a mask of all ones over
    repeated keys/values gives the same forward but other gradient bits (seen on an AMD EPYC VM:
    32 rows x 192 tokens, gradients apart by up to 0.03), which moved a tools SFT's trajectory."""
    from rollout.models.lean_decoder import lean_hidden_states

    model = _model(arch, kv_heads=kv_heads).train()
    rows, width = 16, 48
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 97, (rows, width), generator=gen)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen) if padded else torch.full((rows,), width)
    lengths[0] = width
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    assert bool(mask.all()) != padded
    positions = torch.arange(width).expand(rows, width)
    real = mask.bool()
    weights = torch.randn(int(real.sum()), SMALL["hidden_size"], generator=gen)

    def run(lean):
        model.zero_grad(set_to_none=True)
        hidden = (lean_hidden_states(model, ids, positions, mask) if lean else
                  model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                              use_cache=False).last_hidden_state)
        (hidden[real] * weights).sum().backward()
        return hidden.detach()[real], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lean, plain = run(True), run(False)
    assert torch.equal(lean[0], plain[0])
    assert lean[1].keys() == plain[1].keys() and len(plain[1]) > 10  # every decoder weight (not lm_head)
    assert all(torch.equal(lean[1][n], plain[1][n]) for n in plain[1])
    assert any(g.abs().sum() > 0 for g in plain[1].values())


def test_lean_hidden_states_steps_aside_where_the_forward_does_more():
    """Hooks, a replaced forward, attention dropout while training: None (the caller then calls
    the model); in eval mode dropout does not apply and it runs."""
    from rollout.models.lean_decoder import lean_hidden_states

    ids = torch.randint(3, 97, (1, 5))
    positions = torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    model = _model("qwen2")
    want = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    assert torch.equal(lean_hidden_states(model, ids, positions, mask), want)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_hidden_states(model, ids, positions, mask) is None
    handle.remove()
    model.model.layers[0].self_attn.q_proj.forward = lambda x: x  # e.g. accelerate's offloading
    assert lean_hidden_states(model, ids, positions, mask) is None
    dropout = _model("qwen2", attention_dropout=0.1)
    assert lean_hidden_states(dropout.train(), ids, positions, mask) is None
    assert lean_hidden_states(dropout.eval(), ids, positions, mask) is not None


def test_lean_hidden_states_notices_what_changes_after_it_ran():
    """Its structural checks pass once per model and are remembered (a training step asks on every
    forward); whatever changes after that is still seen: a wrapped projection (LoRA), a module
    swapped in (run, with the new module's weights), another attention kernel, a sliding window,
    activation checkpointing, accelerate's hook attribute. The memo does not keep a model alive."""
    import gc
    import weakref

    from rollout.models.lean_decoder import lean_hidden_states

    ids = torch.randint(3, 97, (1, 5))
    positions = torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]

    def want(m):
        return m.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state

    model = _model("mistral")
    assert torch.equal(lean_hidden_states(model, ids, positions, mask), want(model))
    attn = model.model.layers[0].self_attn
    plain = attn.q_proj
    attn.q_proj = torch.nn.Sequential(plain)
    assert lean_hidden_states(model, ids, positions, mask) is None
    attn.q_proj = torch.nn.Linear(plain.in_features, plain.out_features, bias=plain.bias is not None)
    assert torch.equal(lean_hidden_states(model, ids, positions, mask), want(model))
    model.config.sliding_window = 4
    assert lean_hidden_states(model, ids, positions, mask) is None
    model.config.sliding_window = None
    assert lean_hidden_states(model, ids, positions, mask) is not None
    model.config._attn_implementation = "eager"
    assert lean_hidden_states(model, ids, positions, mask) is None
    model.config._attn_implementation = "sdpa"
    model.model.layers[1].mlp._hf_hook = object()
    assert lean_hidden_states(model, ids, positions, mask) is None
    del model.model.layers[1].mlp._hf_hook
    assert lean_hidden_states(model, ids, positions, mask) is not None
    model.model.layers[1].gradient_checkpointing = True  # what transformers' enabling sets on each layer
    assert lean_hidden_states(model, ids, positions, mask) is None
    model.model.layers[1].gradient_checkpointing = False
    assert lean_hidden_states(model, ids, positions, mask) is not None
    alive = weakref.ref(model)
    del model, attn, plain
    gc.collect()
    assert alive() is None


def test_a_padding_query_never_makes_nan():
    model = _model("qwen2")
    ours, cache, _ = _steps(model, lambda m, *a: lean_decoder(m)(*a))
    assert all(bool(torch.isfinite(x).all()) for x in ours)
    assert all(bool(torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()) for layer in cache.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_give_transformers_bits(dtype):
    """The shortened RMSNorm (torch's `rms_norm` for float32) and rotary (`roll` with a signed sin)
    give exactly what transformers' modules give, not merely close values."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    from rollout.models.lean_decoder import _rms_norm, _rotary

    torch.manual_seed(0)
    for width, rows in ((64, 1), (128, 16), (640, 3), (896, 2)):
        norm = Qwen2RMSNorm(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width))
        x = (torch.randn(rows, 5, width) * 3).to(dtype)
        assert torch.equal(_rms_norm(norm, x), norm(x)), width
    q, k = torch.randn(2, 4, 5, 32).to(dtype), torch.randn(2, 2, 5, 32).to(dtype)
    angles = torch.randn(2, 5, 16)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    signed = torch.cat((-sin[..., :16], sin[..., 16:]), -1)[:, None]
    assert torch.equal(_rotary(q, cos[:, None], signed), want_q)
    assert torch.equal(_rotary(k, cos[:, None], signed), want_k)


@pytest.mark.parametrize("layout", ["onednn", "transposed"])
def test_stacked_projections_give_each_layers_product(layout, monkeypatch):
    """Prepacked, q/k/v (and gate/up) multiply as one stacked copy; split, each part is that
    layer's own product with its bias -- also where only some of the stacked layers have one."""
    from rollout.models import lean_decoder as lean_module

    if layout == "onednn":
        monkeypatch.setattr(lean_module, "PACK_MIN_ELEMENTS", 0)
    else:
        monkeypatch.setattr(lean_module, "_onednn_linear", lambda: False)
    torch.manual_seed(0)
    layers = (torch.nn.Linear(64, 48), torch.nn.Linear(64, 16, bias=False), torch.nn.Linear(64, 16))
    lean = lean_decoder(_model("qwen2"), prepacked=True)
    x = torch.randn(5, 3, 64)
    with torch.inference_mode():
        parts = lean._linears(layers, x)
        assert lean._prepacked[tuple(id(layer) for layer in layers)][0].is_mkldnn == (layout == "onednn")
        assert [p.shape for p in parts] == [(5, 3, 48), (5, 3, 16), (5, 3, 16)]
        for part, layer in zip(parts, layers, strict=True):
            assert torch.allclose(part, layer(x), atol=1e-5, rtol=0)
        lean.set_prepacked(False)  # the weights as they are: one product per layer, the same values
        for part, layer in zip(lean._linears(layers, x), layers, strict=True):
            assert torch.equal(part, layer(x))


def test_gpu_options_stack_plain_copies_that_follow_weight_changes():
    """`stacked` (the engine on a GPU): q/k/v and gate/up multiply as one copy of their weights as
    they are ([out, in], no oneDNN layout), the other products by the weights themselves; the
    copies are dropped by `refresh` and made from the new weights; not with prepacked copies."""
    model = _model("qwen2")
    lean = lean_decoder(model, stacked=True, fused_norms=True)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(3, 1, model.config.hidden_size)
    with torch.inference_mode():
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            for part, proj in zip(lean._linears(group, x), group, strict=True):
                assert torch.allclose(part, proj(x), atol=1e-6, rtol=0)
        assert len(lean._prepacked) == 2
        assert all(not w.is_mkldnn and w.shape[1] == x.shape[-1] for w, _ in lean._prepacked.values())
        lean._linear(attn.o_proj, torch.randn(3, 1, attn.o_proj.in_features))
        assert len(lean._prepacked) == 2  # single products: no copy
        before = attn.k_proj(x)
        with torch.no_grad():
            attn.k_proj.weight.mul_(-1)
        stale = lean._linears((attn.q_proj, attn.k_proj, attn.v_proj), x)[1]
        assert torch.allclose(stale, before, atol=1e-6, rtol=0)  # a copy of the old weights...
        lean.refresh()
        fresh = lean._linears((attn.q_proj, attn.k_proj, attn.v_proj), x)[1]
        assert torch.allclose(fresh, attn.k_proj(x), atol=1e-6, rtol=0)  # ...until the refresh
    for other in ({"prepacked": True}, {"invariant": True}):
        with pytest.raises(ValueError, match="stacked"):
            lean_decoder(model, stacked=True, **other)


def test_fused_norms_round_once_where_transformers_rounds_twice():
    """`fused_norms` is torch's `rms_norm`: in float32 transformers' bits; in bfloat16 within a
    rounding of them (it scales before its one cast, transformers casts, then scales)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    model = _model("qwen2")
    fused = lean_decoder(model, fused_norms=True)
    for dtype in (torch.float32, torch.bfloat16):
        norm = Qwen2RMSNorm(128, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(128))
        x = (torch.randn(16, 3, 128) * 3).to(dtype)
        ours, theirs = fused._norm(norm, x), norm(x)
        if dtype == torch.float32:
            assert torch.equal(ours, theirs)
        else:
            ulp = theirs.float().abs() * 2.0**-7
            assert bool(((ours.float() - theirs.float()).abs() <= ulp).all())
            assert not torch.equal(ours, theirs)  # it does round differently somewhere


def test_models_it_does_not_run_get_none():
    assert lean_decoder(_model("qwen2", attn="eager")) is None  # eager softmax: transformers' path
    windowed = _model("mistral")
    windowed.config.sliding_window = 4
    assert lean_decoder(windowed) is None
    lora = _model("llama")
    lora.model.layers[0].self_attn.q_proj = torch.nn.Sequential(copy.deepcopy(lora.model.layers[0].self_attn.q_proj))
    assert lean_decoder(lora) is None  # a wrapped projection: not a plain nn.Linear
    from transformers import GPT2Config, GPT2LMHeadModel

    assert lean_decoder(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))) is None


def _completions(engine: HFEngine, requests):
    return [(c.token_ids, c.logprobs) for cs in engine.generate(requests) for c in cs]


def test_the_engine_makes_the_same_completions_with_and_without_it(tiny_model_dir):
    lean = load_hf_engine(tiny_model_dir, max_batch_size=6)
    plain = load_hf_engine(tiny_model_dir, max_batch_size=6, lean=False)
    assert lean.lean is not None and plain.lean is None
    # greedy and seeded sampling, n > 1 over shared prompts, more rows than the batch (joiners merge)
    requests = [
        GenerationRequest("What is 3+4?", params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        GenerationRequest("the model reads", params=SamplingParams(temperature=1.0, max_tokens=7, n=4, seed=3)),
        GenerationRequest("a", params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, n=3, seed=4)),
    ]
    ours, theirs = _completions(lean, requests), _completions(plain, requests)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4



@pytest.mark.parametrize("layout", ["onednn", "transposed", "gpu-stacked"])
def test_prepacked_weight_copies_follow_every_weight_change(tiny_model_dir, other_weights_dir, layout, monkeypatch):
    """On the CPU the engine multiplies by prepacked copies of the weights: a weight push, a
    trainer's in-place step on shared parameters (then the push it must make), and sharing a
    policy's parameters each leave it generating what transformers' forward does. "gpu-stacked":
    the same with the lean decoder a GPU engine runs (stacked plain copies, fused norms)."""
    from transformers import AutoModelForCausalLM

    from rollout.models import lean_decoder as lean_module

    monkeypatch.setattr(lean_module, "PACK_MIN_ELEMENTS", 0 if layout == "onednn" else 1 << 62)
    lean = load_hf_engine(tiny_model_dir, max_batch_size=6, device="cpu")  # the copies are the CPU's
    plain = load_hf_engine(tiny_model_dir, max_batch_size=6, lean=False, device="cpu")
    if layout == "gpu-stacked":
        lean.lean = lean_decoder(lean.model, stacked=True, fused_norms=True)
    assert lean.lean is not None and (lean.lean.stacked if layout == "gpu-stacked" else lean.lean.prepacked)
    requests = [GenerationRequest("What is 3+4?", params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
                GenerationRequest("the model", params=SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=5))]

    def same() -> list:
        ours, theirs = _completions(lean, requests), _completions(plain, requests)
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        return [t for t, _ in ours]

    before = same()
    assert {w.is_mkldnn for w, _ in lean.lean._prepacked.values()} == {layout == "onednn"}
    assert len(lean.lean._prepacked) == (2 * len(lean.model.model.layers) if layout == "gpu-stacked" else
                                         4 * len(lean.model.model.layers) + 1)
    for engine in (lean, plain):  # a push from disk
        engine.update_weights(other_weights_dir)
    pushed = same()
    assert pushed != before
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for engine in (lean, plain):  # sharing a policy's parameters (the tiny model's own weights again)
        assert engine.share_parameters(policy)
    assert same() == before
    with torch.no_grad():  # an optimizer step in place on the shared tensors, then the push
        for param in policy.parameters():
            param.mul_(1.5)
    for engine in (lean, plain):
        engine.update_weights(dict(policy.named_parameters()))
    assert same() != before


def test_prepacked_copies_only_for_small_weights_and_never_batch_invariant(tiny_model_dir, monkeypatch):
    from rollout.inference import hf_engine

    assert not load_hf_engine(tiny_model_dir, pad_multiple=16).lean.prepacked
    monkeypatch.setattr(hf_engine, "PREPACKED_MAX_BYTES", 1000)  # the tiny model's 4 MB is "large" now
    engine = load_hf_engine(tiny_model_dir)
    assert engine.lean is not None and not engine.lean.prepacked


def test_rl_rounds_too_short_to_pay_for_weight_copies_run_without_them(tiny_model_dir):
    """An RL trainer replaces the weights after every round, so the engine's prepacked copies are
    made again each round: `plan_weight_copies` keeps them only when a completion may run to at least
    `PREPACK_MIN_TOKENS` tokens, for the whole run (so every round computes the same way). Without
    them the engine still makes transformers' tokens; engines that never copy, or remote ones, say no."""
    from types import SimpleNamespace

    from rollout.algorithms.rl_common import plan_weight_copies
    from rollout.models.lean_decoder import PREPACK_MIN_TOKENS

    engine = load_hf_engine(tiny_model_dir, max_batch_size=6, device="cpu")  # the copies are the CPU's
    plain = load_hf_engine(tiny_model_dir, max_batch_size=6, lean=False, device="cpu")
    requests = [GenerationRequest("What is 3+4?", params=SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=2))]
    expected = _completions(plain, requests)

    def same() -> bool:  # transformers' tokens, its log-probs to float rounding
        ours = _completions(engine, requests)
        return [t for t, _ in ours] == [t for t, _ in expected] and all(
            abs(a - b) < 1e-5 for (_, x), (_, y) in zip(ours, expected, strict=True) for a, b in zip(x, y, strict=True))

    assert same() and engine.lean._prepacked  # copies by default

    rounds = SimpleNamespace(engine=engine)
    assert plan_weight_copies(rounds, max_completion=PREPACK_MIN_TOKENS - 1) is False
    assert not engine.lean.prepacked and engine.lean._prepacked == {}
    assert same() and engine.lean._prepacked == {}

    assert plan_weight_copies(rounds, max_completion=PREPACK_MIN_TOKENS) is True
    assert same() and engine.lean._prepacked

    assert load_hf_engine(tiny_model_dir, pad_multiple=16).use_prepacked_weights(True) is False
    assert plain.use_prepacked_weights(True) is False
    assert plan_weight_copies(SimpleNamespace(engine=object()), max_completion=64) is False


@pytest.mark.parametrize("threads", [1, 2])
def test_fixed_row_products_give_a_row_the_same_bits_whatever_shares_the_call(threads):
    """`_fixed_rows_linear` (the batch-invariant decoder's products): a row's result is bitwise the
    same alone, among few or many other rows, at any place among them, one token a row or several
    (the two chunk sizes), for the tiny and the 48M model's shapes. `F.linear` itself is not, on
    some CPUs (see `INVARIANT_ROWS`): what the chunks are for."""
    from rollout.models.lean_decoder import _fixed_rows_linear

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        for out_f, in_f in [(128, 128), (32, 128), (512, 128), (128, 512), (640, 640), (2560, 640)]:
            weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
            bias = torch.randn(out_f, generator=gen)
            others = torch.randn(100 * 16, in_f, generator=gen)
            row = torch.randn(in_f, generator=gen)
            for t in (1, 16):  # decode (one token a row), prefill
                alone = _fixed_rows_linear(row.expand(1, t, in_f), weight, bias)[0, 0]
                for rows, at in [(2, 1), (5, 4), (23, 11), (24, 0), (25, 24), (40, 17), (97, 96), (100, 3)]:
                    x = others[: rows * t].reshape(rows, t, in_f).clone()
                    x[at, 0] = row
                    assert torch.equal(_fixed_rows_linear(x, weight, bias)[at, 0], alone), (out_f, in_f, t, rows, at)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_batch_invariant_engine_gives_a_request_the_same_log_probs_in_any_batch(tiny_model_dir, threads):
    """`pad_multiple = BATCH_INVARIANT_PAD` (Ray rollout workers, `[backend] batch_invariant`): each
    request's tokens *and* log-probs are bitwise the same generated alone, in small batches and all
    together (40 rows: decode products over more than one chunk), at one and at two threads."""
    from rollout.inference.hf_engine import BATCH_INVARIANT_PAD

    prompts = ["What is 3+4?", "the model reads", "a", "Compute 12 * 7 and then add 5 to it, please.",
               "x", "What is 2+2?", "tell me", "one two three four five six", "9-3", "hello there"]
    requests = [GenerationRequest(p, params=SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=i))
                for i, p in enumerate(prompts)]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = load_hf_engine(tiny_model_dir, max_batch_size=64, pad_multiple=BATCH_INVARIANT_PAD, device="cpu")
        assert engine.lean is not None and engine.lean.invariant
        together = _completions(engine, requests)
        apart = [c for r in requests[:3] for c in _completions(engine, [r])]
        apart += _completions(engine, requests[3:5]) + _completions(engine, requests[5:])
    finally:
        torch.set_num_threads(saved)
    assert apart == together
