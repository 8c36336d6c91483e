"""Completion log-probs on a tiny random Qwen2: direct per-token values, padding, gathered LM head, peft."""

from __future__ import annotations

import pytest
import torch

from rollout.data.collate import collate_packed, collate_padded, collate_pairs
from rollout.data.packing import Segment
from rollout.data.tokenize import TokenizedPair, TokenizedSample
from rollout.losses.logps import completion_logps, decoder_and_head, sequence_logps, target_logps

PAD = 0
# Prompts and answers of different lengths so rows are right-padded differently.
PAIRS = [
    TokenizedPair((5, 17, 9, 30, 4, 8), (5, 17, 9, 30, 77), 3, 3),
    TokenizedPair((40, 2, 61, 99, 3, 12, 101, 7), (40, 2, 61, 99, 1), 4, 4),
    TokenizedPair((11, 50), (11, 51, 52, 53), 1, 1),
]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def direct_logps(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[float]:
    """One token at a time, in float64, with log_softmax."""
    out = []
    for b in range(input_ids.shape[0]):
        total = 0.0
        for t in range(1, input_ids.shape[1]):
            if loss_mask[b, t]:
                total += float(torch.log_softmax(logits[b, t - 1].double(), dim=-1)[input_ids[b, t]])
        out.append(total)
    return out


def test_completion_logps_equals_direct_per_token_computation(model):
    batch, _ = collate_pairs(PAIRS, PAD)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps, counts = completion_logps(logits, batch.input_ids, batch.loss_mask)
    assert logps.dtype == torch.float32 and logps.shape == (6,)
    assert logps.tolist() == pytest.approx(direct_logps(logits, batch.input_ids, batch.loss_mask), abs=1e-5)
    assert counts.tolist() == [3, 4, 1, 2, 1, 3]  # answer tokens: chosen rows, then rejected rows


def test_completion_logps_in_bfloat16_is_computed_in_float32():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 11).bfloat16()
    ids = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [False, True, True, False, False]])
    logps, counts = completion_logps(logits, ids, mask)
    assert logps.dtype == torch.float32
    assert logps.tolist() == pytest.approx(direct_logps(logits.float(), ids, mask), abs=1e-5)
    assert counts.tolist() == [3, 2]


def test_completion_logps_ignores_first_position_and_is_differentiable():
    logits = torch.zeros(1, 3, 4, requires_grad=True)
    logps, counts = completion_logps(logits, torch.tensor([[1, 2, 3]]), torch.tensor([[True, True, False]]))
    assert counts.tolist() == [1]  # position 0 has nothing to be predicted from
    assert float(logps.detach()) == pytest.approx(-torch.log(torch.tensor(4.0)).item(), abs=1e-6)
    logps.sum().backward()
    assert logits.grad[0, 0, 2] > 0 and logits.grad[0, 1].abs().sum() == 0


@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_target_logps_values_and_gradients_equal_log_softmax_in_float64(scale):
    """The hand-written backward (onehot - softmax) against autograd through float64 log_softmax,
    on ordinary rows and on peaked ones (most logits > 87 below the max: exp underflows), with a
    target picked twice (its gradients add up)."""
    torch.manual_seed(2)
    logits = (torch.randn(6, 50) * scale).requires_grad_()
    targets = torch.tensor([3, 3, 49, 0, 17, 3])
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])
    got = target_logps(logits, targets)
    (got * weights).sum().backward()
    ref = logits.detach().double().requires_grad_()
    want = torch.log_softmax(ref, -1).gather(-1, targets[:, None]).squeeze(-1)
    (want * weights.double()).sum().backward()
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5 * scale)
    assert torch.allclose(logits.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
    bf16 = logits.detach().bfloat16().requires_grad_()
    target_logps(bf16, targets).sum().backward()  # float32 math, the gradient back in bfloat16
    assert bf16.grad.dtype == torch.bfloat16 and bool(torch.isfinite(bf16.grad.float()).all())


def test_right_padding_does_not_change_the_result(model):
    batch, _ = collate_pairs(PAIRS, PAD)
    sides = [(p.chosen_ids, p.prompt_len_chosen) for p in PAIRS] + [
        (p.rejected_ids, p.prompt_len_rejected) for p in PAIRS
    ]
    alone = []
    with torch.no_grad():
        padded, _ = sequence_logps(model, batch, gather_lm_head=False)
        for ids, prompt_len in sides:  # each sequence on its own: no padding at all
            mask = (False,) * prompt_len + (True,) * (len(ids) - prompt_len)
            single = collate_padded([TokenizedSample(ids, mask)], PAD)
            assert single.input_ids.shape == (1, len(ids))
            alone.append(float(sequence_logps(model, single, gather_lm_head=False)[0][0]))
    assert batch.attention_mask.min() == 0  # the batch really is padded
    assert padded.tolist() == pytest.approx(alone, abs=1e-5)


def test_gathered_lm_head_equals_full_logits(model):
    batch, _ = collate_pairs(PAIRS, PAD)
    assert decoder_and_head(model) is not None
    with torch.no_grad():
        full, full_counts = sequence_logps(model, batch, gather_lm_head=False)
        gathered, counts = sequence_logps(model, batch)
    assert torch.allclose(gathered, full, atol=1e-5, rtol=0)
    assert torch.equal(counts, full_counts)


def test_gathered_lm_head_gradients_match_full_logits(model):
    batch, _ = collate_pairs(PAIRS[:2], PAD)
    grads = []
    for gather in (False, True):
        model.zero_grad()
        logps, _ = sequence_logps(model, batch, gather_lm_head=gather)
        logps.sum().backward()
        grads.append(model.lm_head.weight.grad.clone())
    model.zero_grad()
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_models_that_transform_their_logits_use_the_full_forward(model, monkeypatch):
    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)
    assert decoder_and_head(model) is None


def test_peft_wrapped_model(model):
    peft = pytest.importorskip("peft")
    import copy

    lora = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    assert decoder_and_head(lora) is not None
    batch, _ = collate_pairs(PAIRS, PAD)
    with torch.no_grad():
        full, _ = sequence_logps(lora, batch, gather_lm_head=False)
        gathered, _ = sequence_logps(lora, batch)
        with lora.disable_adapter():
            disabled, _ = sequence_logps(lora, batch)
        base, _ = sequence_logps(model, batch)
    assert torch.allclose(gathered, full, atol=1e-5, rtol=0)
    assert not torch.allclose(gathered, base, atol=1e-3)  # the adapter is applied
    assert torch.allclose(disabled, base, atol=1e-5, rtol=0)  # and can be switched off for the reference


def test_packed_batches_are_refused(model):
    samples = [TokenizedSample((1, 2, 3), (False, True, True)), TokenizedSample((4, 5), (False, True))]
    packed = collate_packed([[Segment(0, 0, 3), Segment(1, 0, 2)]], samples, PAD)
    with pytest.raises(ValueError, match="packed"):
        sequence_logps(model, packed)


@pytest.mark.parametrize("positions", ["given", "none"])
def test_the_decoder_runs_lean_with_the_bits_of_the_model(model, positions, monkeypatch):
    """`sequence_logps` runs the plain decoder through `lean_decoder.lean_hidden_states` (padded
    rows; without position ids, 0.. as transformers takes them): log-probs and every gradient equal
    those of `decoder(...)` bit for bit. A LoRA-wrapped model takes the decoder
    (`test_peft_wrapped_model`)."""
    import dataclasses

    from rollout.models import lean_decoder

    batch, _ = collate_pairs(PAIRS, PAD)
    if positions == "none":
        batch = dataclasses.replace(batch, position_ids=None)
    assert batch.attention_mask.min() == 0
    calls = []
    real = lean_decoder.lean_hidden_states

    def run(lean: bool):
        monkeypatch.setattr(lean_decoder, "lean_hidden_states",
                            (lambda *a: calls.append(1) or real(*a)) if lean else (lambda *a: None))
        model.zero_grad(set_to_none=True)
        logps, _ = sequence_logps(model, batch)
        (logps * torch.linspace(-1, 1, logps.numel())).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lean, plain = run(True), run(False)
    model.zero_grad(set_to_none=True)
    assert calls == [1]
    assert torch.equal(lean[0], plain[0])
    assert all(torch.equal(lean[1][n], plain[1][n]) for n in plain[1])
