"""KTO's reference pass: the lines and their mismatched partners (line i's prompt with line i+1's
completion) scored in one pass with each prompt once give the two full-row passes' sums."""

from __future__ import annotations

import torch

from rollout.algorithms.kto import mismatched_samples, reference_logps, shared_kto_rows
from rollout.algorithms.reference import Reference
from rollout.data.collate import collate_padded
from rollout.data.tokenize import TokenizedSample

PAD = 0


def _sample(prompt: tuple[int, ...], completion: tuple[int, ...], tail: tuple[int, ...] = ()) -> TokenizedSample:
    """`tail`: tokens after the completion that are not loss tokens (a chat template's newline)."""
    return TokenizedSample(prompt + completion + tail,
                           (False,) * len(prompt) + (True,) * len(completion) + (False,) * len(tail))


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_one_shared_reference_pass_gives_both_sets_of_sums():
    samples = [_sample((5, 17, 9, 30), (4, 8), (13,)), _sample((40, 2, 61), (3, 12, 101, 7), (13,)),
               _sample((5, 17, 9, 30), (77,), (13,)), _sample((11, 50, 6, 7, 8), (51, 52))]
    mismatched = mismatched_samples(samples, max_seq_len=64)
    idx = [2, 0, 3]  # a micro-batch: some lines, in the sampler's order
    tokens = collate_padded([samples[i] for i in idx], PAD)
    kl_tokens = collate_padded([mismatched[i] for i in idx], PAD)
    shared = shared_kto_rows([samples[i] for i in idx], [mismatched[i] for i in idx], PAD, "cpu")
    assert shared is not None and shared.num_rows == 6
    assert shared.prompt_ids.shape[0] == 2  # each prompt once: lines 2 and 0 share theirs, line 3 has its own
    assert shared.num_tokens < tokens.num_tokens + kl_tokens.num_tokens

    ref = Reference(kind="copy", model=_model())
    one = reference_logps(ref, tokens, kl_tokens, idx, len(samples), shared)
    two = reference_logps(ref, tokens, kl_tokens, idx, len(samples), None)
    for a, b in zip(one, two, strict=True):
        assert a.shape == (3,)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(one[0], one[1], atol=1e-3)  # matched and mismatched really differ

    table = Reference(kind="table", table=torch.arange(2 * len(samples), dtype=torch.float64))
    matched, kl = reference_logps(table, tokens, kl_tokens, idx, len(samples), None)
    assert matched.tolist() == [2.0, 0.0, 3.0] and kl.tolist() == [6.0, 4.0, 7.0]


def test_an_empty_prompt_falls_back_to_full_rows():
    samples = [_sample((), (4, 8)), _sample((40, 2), (3,))]
    assert shared_kto_rows(samples, mismatched_samples(samples, max_seq_len=64), PAD, "cpu") is None
