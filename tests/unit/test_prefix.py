"""Shared-prompt log-probs: each prompt run once, equal to the full rows in values and gradients,
in both layouts (each prompt's completions packed behind it in one row, or the per-row cache)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.models import prefix
from rollout.models.prefix import (
    call_tokens,
    collate_prefix,
    frozen_prefix_logps,
    packed_layout,
    packing_is_cheaper,
    pad_rows,
    prefix_logps,
)

PAD = 0
PROMPTS = [(5, 17, 9, 30, 4, 8, 21), (40, 2, 61), (11, 50, 3, 3, 9)]
# 7 rows over 3 prompts (in mixed order), completions of 1 to 5 tokens
ROWS = [(0, (7, 8, 9)), (1, (12,)), (0, (7, 100, 3, 4, 5)), (2, (1, 2)), (1, (60, 61, 62)), (0, (44,)), (2, (9, 9, 9, 9))]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(params=["packed", "cache"])
def layout(request, monkeypatch):
    """The test runs once per layout, whatever the cost model would choose for its batch."""
    force = request.param == "packed"

    def forced(batch, config, dtype=torch.float32, *, force_=force):
        return packed_layout(batch, config, dtype, force=force_)

    monkeypatch.setattr(prefix, "packed_layout", forced)
    return request.param


def _batch():
    return collate_prefix([PROMPTS[p] for p, _ in ROWS], [c for _, c in ROWS], PAD)


def _direct(model, temperature: float = 1.0) -> list[list[float]]:
    """Each full row alone (no padding at all), one token at a time, in float64, under
    softmax(logits / temperature)."""
    out = []
    for p, c in ROWS:
        ids = torch.tensor([PROMPTS[p] + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / temperature
        out.append([float(torch.log_softmax(logits[len(PROMPTS[p]) + j - 1], -1)[tok]) for j, tok in enumerate(c)])
    return out


def _rows(logps, batch) -> list[list[float]]:
    return [logps[i][batch.completion_mask[i]].tolist() for i in range(batch.num_rows)]


def test_collate_stores_each_prompt_once():
    b = _batch()
    assert b.prompt_ids.shape == (3, 7) and b.owner.tolist() == [0, 1, 0, 2, 1, 0, 2]
    assert b.prompt_ids[1].tolist() == [PAD] * 4 + [40, 2, 61]  # left-padded
    assert b.completion_ids[1].tolist() == [12, PAD, PAD, PAD, PAD]  # right-padded
    assert b.num_tokens == 15 + 19 and b.num_row_tokens == (7 * 3 + 3 * 2 + 5 * 2) + 19
    with pytest.raises(ValueError, match="prompt token"):
        collate_prefix([()], [(1,)], PAD)


def test_logps_equal_the_full_rows_one_token_at_a_time(model, layout):
    b = _batch()
    logps, entropy = prefix_logps(model, b, with_entropy=True)
    for got, want in zip(_rows(logps, b), _direct(model), strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert logps[~b.completion_mask].abs().sum() == 0 and entropy[~b.completion_mask].abs().sum() == 0
    assert bool((entropy[b.completion_mask] > 0).all())


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_logps_at_a_temperature_are_of_the_scaled_distribution(model, layout, temperature):
    """RL trains the distribution it samples: softmax(logits / T); entropies are of it too."""
    b = _batch()
    logps, entropy = prefix_logps(model, b, with_entropy=True, temperature=temperature)
    plain, plain_entropy = prefix_logps(model, b, with_entropy=True)
    for got, want in zip(_rows(logps, b), _direct(model, temperature), strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert (logps - plain)[b.completion_mask].abs().max() > 1e-3
    sharper = temperature < 1
    assert bool(((entropy < plain_entropy) == sharper)[b.completion_mask].all())
    frozen = frozen_prefix_logps(model, b, temperature=temperature)
    assert torch.allclose(frozen, logps, atol=1e-6)


def test_entropies_are_minus_sum_p_log_p_even_where_p_underflows(model):
    """At temperature 0.005 most of the vocabulary has log p far below -87, where float32 exp
    underflows: each entropy still equals -sum p log p of its row's full distribution (float64)."""
    b = _batch()
    _, entropy = prefix_logps(model, b, with_entropy=True, temperature=0.005)
    want = []
    for p, c in ROWS:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPTS[p] + c])).logits[0].double() / 0.005
        logp = torch.log_softmax(logits[len(PROMPTS[p]) - 1 : len(PROMPTS[p]) + len(c) - 1], -1)
        assert float(logp.min()) < -87  # the regime the softmax-based entropy is there for
        want.append((-(logp.exp() * logp).sum(-1)).tolist())
    for got, expected in zip(_rows(entropy, b), want, strict=True):
        assert got == pytest.approx(expected, abs=1e-4)


def test_gradients_equal_the_full_rows(model, layout):
    m = copy.deepcopy(model).train()
    b = _batch()
    weights = torch.linspace(-1, 2, len(ROWS))
    (prefix_logps(m, b)[0].sum(1) * weights).sum().backward()
    shared = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    for (p, c), w in zip(ROWS, weights, strict=True):  # each full row alone
        logp = torch.log_softmax(m(input_ids=torch.tensor([PROMPTS[p] + c])).logits[0].float(), -1)
        picked = logp[len(PROMPTS[p]) - 1 : -1].gather(1, torch.tensor(c)[:, None])
        (picked.sum() * w).backward()
    for name, p in m.named_parameters():
        assert torch.allclose(shared[name], p.grad, atol=1e-5, rtol=1e-4), name


def test_gradients_are_the_same_bits_every_pass_on_two_threads(layout):
    """A prompt's last position feeds each of its completions, and the backward adds their
    gradients. Through `x[index]` that sum ran as atomic adds on two threads, in a different order
    each pass where one prompt's rows are not adjacent (two groups of one prompt, as dynamic
    sampling's refills make): 10 passes gave 10 different gradients in either layout, and GRPO at
    two threads was not the same run to run. Every pass must give the same bits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=64)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(config).train()
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(1, 64, (int(n),), generator=g).tolist()) for n in torch.randint(5, 16, (8,), generator=g)]
    rows = [(p % 8, tuple(torch.randint(1, 64, (int(n),), generator=g).tolist()))  # prompts 0..7, then 0..7 again
            for p in range(16) for n in torch.randint(1, 5, (8,), generator=g)]
    b = collate_prefix([prompts[p] for p, _ in rows], [c for _, c in rows], PAD)
    weights = torch.randn(len(rows), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = set()
        for _ in range(6):
            m.zero_grad(set_to_none=True)
            (prefix_logps(m, b)[0].sum(1) * weights).sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in m.parameters()))
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1


def test_select_keeps_only_the_prompts_its_rows_use(model, layout):
    b = _batch()
    sub = b.select([1, 4, 3])
    assert sub.prompt_ids.shape == (2, 5) and sub.owner.tolist() == [0, 0, 1]
    assert sub.completion_ids.shape == (3, 5)  # columns unchanged: [B, Lc] tensors index alike
    whole, part = _rows(frozen_prefix_logps(model, b), b), _rows(frozen_prefix_logps(model, sub), sub)
    for i, row in enumerate([1, 4, 3]):
        assert part[i] == pytest.approx(whole[row], abs=1e-5)


def test_models_that_transform_their_logits_run_their_own_forward(model, layout, monkeypatch):
    from rollout.losses.logps import decoder_and_head

    m = copy.deepcopy(model)
    monkeypatch.setattr(m.config, "final_logit_softcapping", 30.0, raising=False)
    assert decoder_and_head(m) is None  # the generic path: the model's own logits
    b = _batch()
    for got, want in zip(_rows(frozen_prefix_logps(m, b), b), _direct(model), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_peft_adapter_on_and_off(model, layout):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    b = _batch()
    on, off = frozen_prefix_logps(lora, b), frozen_prefix_logps(lora, b, adapter_disabled=True)
    assert torch.allclose(off, frozen_prefix_logps(model, b), atol=1e-5)
    assert not torch.allclose(on, off, atol=1e-3)


def test_pad_rows():
    assert pad_rows([[1.0, 2.0], [], [3.0]], 3).tolist() == [[1, 2, 0], [0, 0, 0], [3, 0, 0]]
    row = [-0.1, -2.3456789012345]  # float32 as torch.tensor rounds it
    assert torch.equal(pad_rows([row, None], 2), torch.tensor([row, [0.0, 0.0]], dtype=torch.float32))
    with pytest.raises(ValueError, match="3 values for 2 columns"):
        pad_rows([[1.0, 2.0, 3.0]], 2)


def test_collated_tensors_masks_and_dtypes():
    """Every tensor of a collated batch, element by element, loss masks included (a row without
    one counts all its tokens), and a loss mask of the wrong length refused."""
    b = collate_prefix([(5, 17, 9), (40, 2), (5, 17, 9)], [(7, 8), (12,), ()], PAD,
                       [(True, False), None, ()])
    assert b.prompt_ids.dtype == torch.long and b.prompt_ids.tolist() == [[5, 17, 9], [PAD, 40, 2]]
    assert b.prompt_mask.dtype == torch.bool and b.prompt_mask.tolist() == [[True] * 3, [False, True, True]]
    assert b.completion_ids.tolist() == [[7, 8], [12, PAD], [PAD, PAD]]
    assert b.completion_mask.tolist() == [[True, True], [True, False], [False, False]]
    assert b.loss_mask is not None and b.loss_mask.dtype == torch.bool
    assert b.loss_mask.tolist() == [[True, False], [True, False], [False, False]]
    assert b.owner.dtype == torch.long and b.owner.tolist() == [0, 1, 0]
    assert collate_prefix([(5,)], [(7,)], PAD, [None]).loss_mask is None
    with pytest.raises(ValueError, match="a loss mask of 1 for 2 completion tokens"):
        collate_prefix([(5,)], [(7, 8)], PAD, [(True,)])


def test_pairs_share_their_prompt_and_score_like_the_full_rows(model, layout):
    from rollout.data.collate import collate_pairs
    from rollout.data.tokenize import TokenizedPair
    from rollout.losses.logps import sequence_logps
    from rollout.models.prefix import collate_shared_pairs, rows_logps

    pairs = [
        TokenizedPair((5, 17, 9, 30, 4, 8), (5, 17, 9, 30, 77), 3, 3),
        TokenizedPair((40, 2, 61, 99, 3, 12, 101, 7), (40, 2, 61, 99, 1), 4, 4),
        TokenizedPair((11, 50), (11, 51, 52, 53), 1, 1),
    ]
    shared = collate_shared_pairs(pairs, PAD)
    assert shared.prompt_ids.shape[0] == 3 and shared.owner.tolist() == [0, 1, 2, 0, 1, 2]
    full, _ = collate_pairs(pairs, PAD)
    with torch.no_grad():
        want, want_counts = sequence_logps(model, full)
        got, counts = rows_logps(model, full, shared)
    assert torch.allclose(got, want, atol=1e-5) and counts.tolist() == want_counts.tolist()
    # a pair whose two sides disagree on the prompt tokens cannot share it
    assert collate_shared_pairs([TokenizedPair((1, 2, 3), (1, 4, 3), 2, 2)], PAD) is None


def test_reward_scores_of_shared_prompts_equal_the_full_rows(layout):
    """The RM scores the last real token of each side: with each prompt run once the scores and
    their gradients equal the full rows', an empty side (prompt only) included."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rollout.algorithms.rm import collate_pair_batch, score_sequences
    from rollout.data.tokenize import TokenizedPair

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, num_labels=1, pad_token_id=PAD)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(config)
    pairs = [
        TokenizedPair((5, 17, 9, 30, 4, 8), (5, 17, 9, 30, 77), 3, 3),
        TokenizedPair((40, 2, 61, 99, 3, 12, 101, 7), (40, 2, 61, 99), 4, 4),  # rejected: nothing after the prompt
        TokenizedPair((11, 50), (11, 51, 52, 53), 1, 1),
    ]
    batch = collate_pair_batch(pairs, [0.0] * 3, PAD)
    assert batch.shared is not None and batch.shared.num_tokens < int(batch.tokens.attention_mask.sum())
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])

    def scores_and_grads(shared):
        rm.zero_grad()
        scores = score_sequences(rm, batch.tokens, shared)
        (scores * weights).sum().backward()
        return scores.detach(), {n: p.grad.clone() for n, p in rm.named_parameters()}

    got, shared_grads = scores_and_grads(batch.shared)
    _, full_grads = scores_and_grads(None)
    alone = [rm(input_ids=torch.tensor([ids])).logits[0, 0].item()
             for ids in [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]]
    assert got.tolist() == pytest.approx(alone, abs=1e-5)
    for name, grad in shared_grads.items():
        assert torch.allclose(grad, full_grads[name], atol=1e-5, rtol=1e-4), name


def test_packed_rows_put_each_completion_behind_its_prompt_seeing_only_itself(model):
    b = collate_prefix([(5, 17, 9), (40, 2), (5, 17, 9)], [(7, 8), (12,), (60,)], PAD)
    packed = packed_layout(b, model.config, force=True)
    assert packed.input_ids.tolist() == [[5, 17, 9, 7, 8, 60], [40, 2, 12, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 0, 0, 0]]
    mask = packed.attention_mask[:, 0]
    assert mask[0, 5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # completion 60: its prompt and itself
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert mask[1, 4].nonzero().flatten().tolist() == [0, 1]  # a pad sees the prompt (no empty softmax row)
    assert not bool(mask[1, :, 3:].any())  # and no query sees a pad
    # column j: the position before completion token j (the prompt's last token for j = 0)
    assert packed.row.flatten().tolist() == [0, 1, 0]
    assert packed.column.tolist() == [[2, 3, 4], [1, 2, 1], [2, 5, 2]]


def test_the_cheaper_layout_is_chosen(model):
    # GRPO on a small task: 2 prompts x 8 completions of uneven short length -> packed
    short = collate_prefix([(5, 17, 9, 30, 4, 8, 21)] * 8 + [(40, 2, 61, 3)] * 8,
                           [(1,) * (1 + i % 3) for i in range(15)] + [(1,) * 8], PAD)
    assert packed_layout(short, model.config) is not None
    # every completion at full length: equal tokens either way, and the packed layout saves the
    # cache layout's second forward call (`call_tokens`)
    full = collate_prefix([(5, 17, 9, 30, 4, 8, 21)] * 8 + [(40, 2, 61, 3, 7, 9, 11)] * 8, [(1,) * 8] * 16, PAD)
    layout = packed_layout(full, model.config)
    assert layout is not None and layout.input_ids.numel() == full.prompt_ids.numel() + full.completion_ids.numel()
    # a DPO batch of the benchmark's shape on the tiny Qwen2's width: 16 pairs, 14 distinct prompts
    # of 11-15 tokens, answers of 2-5 tokens. The packed rows hold more tokens but make one call;
    # with the second call priced at 64 tokens (before `CALL_DISPATCH`) the cache layout was kept,
    # which ran such batches 1.4-1.5x slower
    pairs = [tuple([5 + min(i, 13)] * (11 + min(i, 13) % 5)) for i in range(16) for _ in range(2)]
    dpo = collate_prefix(pairs, [(7,) * (2 + i // 2 % 3 + i % 2) for i in range(32)], PAD)
    tiny = copy.deepcopy(model.config)
    tiny.hidden_size = 128
    assert call_tokens(tiny) == 64 + (1 << 21) // 128**2 == 192
    assert packed_layout(dpo, tiny) is not None
    # a long shared prompt with long completions of one length: the cache computes nothing twice
    long = collate_prefix([tuple(range(1, 100))] * 8, [(1,) * 60] * 8, PAD)
    assert packed_layout(long, model.config) is None
    assert packed_layout(long, model.config, force=True) is not None
    flash = copy.deepcopy(model.config)
    flash._attn_implementation = "flash_attention_2"  # takes no dense mask
    assert packed_layout(short, flash, force=True) is None
    windowed = copy.deepcopy(model.config)
    windowed.sliding_window, windowed.layer_types = 8, ["sliding_attention"] * windowed.num_hidden_layers
    assert packed_layout(short, windowed, force=True) is None  # a packed row would outgrow the window


def test_on_a_gpu_a_second_forward_call_is_priced_as_its_launches(model):
    """The H200 measurement behind `CALL_LAUNCHES`: GRPO on a random 191M Qwen2 (h = 1024), 8 prompts
    of 15 tokens x 8 completions of 32 -- equal tokens in both layouts, so the second call decides.
    The CPU's price keeps the cache layout; a GPU's packs (there 0.051 s against 0.115 per step)."""
    large = copy.deepcopy(model.config)
    large.hidden_size = 1024
    assert call_tokens(large) == 64 + 2 and call_tokens(large, "cuda") == 64 + 4096
    shape = dict(n_prompts=8, lp=15, n_rows=64, lc=32, width=15 + 8 * 32)
    assert not packing_is_cheaper(large, **shape)
    assert packing_is_cheaper(large, **shape, device_type="cuda")
    # a long prompt shared by long completions of one length still keeps the cache on a GPU at h = 4096
    wide = copy.deepcopy(model.config)
    wide.hidden_size = 4096
    assert not packing_is_cheaper(wide, n_prompts=8, lp=1024, n_rows=64, lc=512, width=1024 + 8 * 512,
                                  device_type="cuda")


def test_eager_attention_packs_with_an_additive_mask(model):
    m = copy.deepcopy(model)
    m.config._attn_implementation = "eager"
    b = _batch()
    packed = packed_layout(b, m.config, torch.float32, force=True)
    assert packed.attention_mask.dtype == torch.float32 and float(packed.attention_mask.max()) == 0.0
    for got, want in zip(_rows(frozen_prefix_logps(m, b), b), _direct(model), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_empty_completions_score_nothing_in_either_layout(model, layout):
    b = collate_prefix([(5, 17, 9), (5, 17, 9), (40, 2)], [(), (7, 8), ()], PAD)
    logps = frozen_prefix_logps(model, b)
    assert logps[0].abs().sum() == 0 and logps[2].abs().sum() == 0
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([[5, 17, 9, 7, 8]])).logits[0], -1)
    assert logps[1].tolist() == pytest.approx([float(want[2, 7]), float(want[3, 8])], abs=1e-5)


def test_reward_scores_run_the_decoder_lean_with_the_bits_of_the_model(layout, monkeypatch):
    """The RM's decoder runs through `lean_hidden_states` (full rows, and shared prompts in the
    packed layout): scores and every gradient equal those of the transformers decoder bit for bit."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rollout.algorithms import rm as rm_module
    from rollout.data.tokenize import TokenizedPair
    from rollout.models import lean_decoder

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, num_labels=1, pad_token_id=PAD)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(config)
    pairs = [TokenizedPair((5, 17, 9, 30, 4, 8), (5, 17, 9, 30, 77), 3, 3),
             TokenizedPair((11, 50), (11, 51, 52, 53), 1, 1)]
    batch = rm_module.collate_pair_batch(pairs, [0.0] * 2, PAD)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    calls = []
    real = lean_decoder.lean_hidden_states

    def run(shared, lean: bool):
        stand_in = (lambda *a: calls.append(1) or real(*a)) if lean else (lambda *a: None)
        monkeypatch.setattr(lean_decoder, "lean_hidden_states", stand_in)
        rm.zero_grad(set_to_none=True)
        scores = rm_module.score_sequences(rm, batch.tokens, shared)
        (scores * weights).sum().backward()
        return scores.detach(), {n: p.grad.clone() for n, p in rm.named_parameters()}

    for shared in (None, batch.shared):
        calls.clear()
        lean, plain = run(shared, True), run(shared, False)
        assert len(calls) == (0 if shared is not None and layout == "cache" else 1)
        assert torch.equal(lean[0], plain[0])
        assert all(torch.equal(lean[1][n], plain[1][n]) for n in plain[1])


def test_a_moved_batch_s_log_probs_wait_for_nothing_and_are_the_same_bits(model, layout):
    """A batch after `.to(device)` carries its completion tokens' flat index, made where the mask
    was (the host): its training pass (log-probs, entropy, gradients) reads nothing back from the
    device. Counted on the CPU: `_local_scalar_dense` is a value read, a boolean mask's indexing
    reads the mask's count; on a GPU each makes the host wait. (The packed layout reads the rows'
    lengths once with a `tolist`, by design: its layout is built on the host.)"""
    from readbacks import Waits

    fresh = _batch()
    moved = fresh.to("cpu")
    assert moved.completion_index is not None and fresh.completion_index is None
    sel = fresh.completion_mask
    assert moved.completion_index.tolist() == sel.reshape(-1).nonzero().squeeze(1).tolist()
    hidden = torch.randn(*sel.shape, 5)
    assert torch.equal(moved.completion_tokens(hidden), hidden[sel])
    assert torch.equal(fresh.completion_tokens(hidden), hidden[sel])
    grads = []
    for batch, counted in ((fresh, False), (moved, True)):
        model.zero_grad()
        with Waits() as waits:
            logps, entropy = prefix_logps(model, batch, with_entropy=True)
            (logps.sum() + entropy.sum()).backward()
        if counted and layout == "packed":
            assert waits.counts == {}
        elif counted:  # the cache layout's second call: transformers' sdpa mask builder reads its mask's
            # values (`_ignore_causal_mask_sdpa`), as in any transformers forward; nothing of ours does
            assert set(waits.counts) <= {"_local_scalar_dense"}
        grads.append([p.grad.clone() for p in model.parameters()])
        if not counted:
            first = (logps, entropy)
    assert torch.equal(first[0], logps) and torch.equal(first[1], entropy)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
