"""Acceptance: a packed batch gives every sample exactly the loss it gets unpacked.

A small random Qwen2 runs the same tokenized samples one per (padded) row and
packed (bfd, and wrapped for the samples that were not cut); per-sample mean
cross-entropy must agree within 1e-5 for both sdpa and eager attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.data.collate import TokenBatch, attention_mask_for, collate_packed, collate_padded
from rollout.data.jsonl import Row
from rollout.data.packing import pack_bfd, pack_wrapped
from rollout.data.tokenize import tokenize_sft

ROWS = [
    {"messages": [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]},
    {"prompt": "Question: what is the capital of France? Answer:", "completion": " Paris."},
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me about the fox."},
            {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
        ]
    },
    {"prompt": "the model learns", "completion": " the answer and then the student checks the result"},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]},
    {"prompt": "2+3=", "completion": " 5"},
    {"prompt": "The quick brown fox", "completion": " jumps over the lazy dog, and then the model learns."},
    {"messages": [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"}]},
]


@pytest.fixture(scope="module")
def samples(chatml_tokenizer):
    rows = [Row(line=i + 1, data=d) for i, d in enumerate(ROWS)]
    samples, stats = tokenize_sft(rows, chatml_tokenizer, loss_on="assistant", max_seq_len=48)
    assert stats.num_dropped == 0 and len(samples) == len(ROWS)
    return samples


@pytest.fixture(scope="module")
def model(chatml_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(chatml_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=chatml_tokenizer.pad_token_id,
        eos_token_id=chatml_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    return model


def token_losses(
    model, batch: TokenBatch, impl: str, mask=...
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-target-token CE [B, T-1], its weight (target AND same-segment predecessor), and the target's sample."""
    model.set_attn_implementation(impl)
    if mask is ...:
        mask = attention_mask_for(batch, attn_implementation=impl, dtype=torch.float32)
    with torch.no_grad():
        # use_cache=False matters for mask=None: with a KV cache transformers skips its
        # packed-sequence detection from position_ids
        logits = model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False
        ).logits
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    same_segment = (batch.sample_index[:, 1:] == batch.sample_index[:, :-1]) & (
        batch.position_ids[:, 1:] == batch.position_ids[:, :-1] + 1
    )
    weight = batch.loss_mask[:, 1:] & same_segment
    assert int(weight.sum()) == batch.num_loss_tokens
    return ce, weight, batch.sample_index[:, 1:]


def per_sample_mean(ce, weight, index, num_samples: int) -> dict[int, float]:
    sums = torch.zeros(num_samples, dtype=torch.float64).index_add_(0, index[weight], ce[weight].double())
    counts = torch.zeros(num_samples, dtype=torch.float64).index_add_(
        0, index[weight], torch.ones_like(ce[weight]).double()
    )
    return {i: float(sums[i] / counts[i]) for i in range(num_samples) if counts[i] > 0}


def unpacked_losses(model, samples, impl, pad_id):
    batch = collate_padded(samples, pad_id)
    ce, weight, index = token_losses(model, batch, impl)
    return per_sample_mean(ce, weight, index, len(samples)), (ce, weight, index, batch)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bfd_packed_losses_equal_unpacked(model, samples, chatml_tokenizer, impl):
    pad = chatml_tokenizer.pad_token_id
    reference, _ = unpacked_losses(model, samples, impl, pad)
    assert len(reference) == len(samples)
    rows = pack_bfd([len(s.input_ids) for s in samples], 64)
    assert len(rows) < len(samples) and any(len(r) > 1 for r in rows)
    batch = collate_packed(rows, samples, pad, pad_to=64)
    assert (batch.sample_index == -1).any()  # some padding is exercised too
    packed = per_sample_mean(*token_losses(model, batch, impl), len(samples))
    assert packed.keys() == reference.keys()
    for i in reference:
        assert packed[i] == pytest.approx(reference[i], abs=1e-5), f"sample {i}"
    # transformers' own packed-sequence detection from restarting position_ids (the path
    # flash-attention takes, attention_mask=None) agrees as well
    from_positions = per_sample_mean(*token_losses(model, batch, impl, mask=None), len(samples))
    for i in reference:
        assert from_positions[i] == pytest.approx(reference[i], abs=1e-5), f"sample {i} (position_ids)"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_wrapped_packed_losses_equal_unpacked_for_uncut_samples(model, samples, chatml_tokenizer, impl):
    pad = chatml_tokenizer.pad_token_id
    reference, (ref_ce, ref_weight, _, _) = unpacked_losses(model, samples, impl, pad)
    rows = pack_wrapped([len(s.input_ids) for s in samples], 40)
    segments = [s for row in rows for s in row]
    cut = {s.sample for s in segments if s.end - s.start < len(samples[s.sample].input_ids)}
    assert cut and len(cut) < len(samples)
    batch = collate_packed(rows, samples, pad)
    ce, weight, index = token_losses(model, batch, impl)
    packed = per_sample_mean(ce, weight, index, len(samples))
    for i in set(reference) - cut:
        assert packed[i] == pytest.approx(reference[i], abs=1e-5), f"sample {i}"
    # the first piece of a cut sample sees its true prefix: its token losses match too
    for b, row in enumerate(rows):
        t = 0
        for s in row:
            if s.sample in cut and s.start == 0:
                got = ce[b, t : t + s.end - 1][weight[b, t : t + s.end - 1]]
                want = ref_ce[s.sample, : s.end - 1][ref_weight[s.sample, : s.end - 1]]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            t += s.end - s.start


@pytest.mark.parametrize("layout", ["padded", "unpadded", "packed"])
def test_sft_loss_runs_the_decoder_lean_with_the_bits_of_the_model(model, samples, chatml_tokenizer, layout,
                                                                  monkeypatch):
    """SFT's loss runs padded and packed (sdpa) batches through `lean_hidden_states`: its loss and
    every parameter's gradient equal those of the transformers decoder bit for bit; LoRA-wrapped,
    hooked or eager models take the decoder (`test_lean_decoder.py`)."""
    from rollout.algorithms import sft
    from rollout.models import lean_decoder

    pad = chatml_tokenizer.pad_token_id
    if layout == "packed":
        batch = collate_packed(pack_bfd([len(s.input_ids) for s in samples], 64), samples, pad, pad_to=64)
    else:
        same = [s for s in samples if len(s.input_ids) == len(samples[0].input_ids)]
        batch = collate_padded(same if layout == "unpadded" else samples, pad)
        assert bool(batch.attention_mask.bool().all()) == (layout == "unpadded")
    model.set_attn_implementation("sdpa")
    calls = []
    real = lean_decoder.lean_hidden_states

    def run(lean: bool):
        monkeypatch.setattr(lean_decoder, "lean_hidden_states", (lambda *a: calls.append(a) or real(*a)) if lean
                            else (lambda *a: None))
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss, metrics = sft.make_sft_loss_fn(float(batch.num_loss_tokens))(model, batch)
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lean, plain = run(True), run(False)
    assert len(calls) == 1
    assert torch.equal(lean[0], plain[0]) and lean[0] > 0
    assert all(torch.equal(lean[1][n], plain[1][n]) for n in plain[1])
    model.zero_grad(set_to_none=True)
