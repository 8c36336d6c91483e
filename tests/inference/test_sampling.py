"""Token selection: draws follow the filtered, tempered distribution; a row's draw is its own."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.inference.sampling import choose_tokens, inverse_cdf

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _rows(n: int, *, temperature: float, top_k: int = 0, top_p: float = 1.0):
    return (
        LOGITS.expand(n, -1).clone(),
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        [torch.Generator().manual_seed(seed) for seed in range(n)],
    )


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"drew tokens of probability 0: {counts.tolist()}"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


# 20,000 rows, one draw each, seeds 0..19,999. With 5 degrees of freedom, chi-square exceeds 25 with
# probability ~1.4e-4 for a correct sampler; a sampler off by 1% of mass on one token of 20% gives ~100.
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "expected"),
    [
        (1.0, 0, 1.0, LOGITS.softmax(-1)),
        (0.7, 0, 1.0, (LOGITS / 0.7).softmax(-1)),
        (1.5, 3, 1.0, torch.cat([(LOGITS[:3] / 1.5).softmax(-1), torch.zeros(3)])),
        # top-p 0.8 at temperature 1: masses 0.57, 0.21, 0.13, ... -- the first three reach 0.8
        (1.0, 0, 0.8, torch.cat([LOGITS[:3].softmax(-1), torch.zeros(3)])),
    ],
)
def test_draw_frequencies_follow_the_filtered_tempered_distribution(
    temperature: float, top_k: int, top_p: float, expected: torch.Tensor
) -> None:
    tokens = choose_tokens(*_rows(20_000, temperature=temperature, top_k=top_k, top_p=top_p))
    assert _chi_square(tokens, expected) < 25


def test_each_row_draws_one_uniform_from_its_own_generator_whatever_the_batch() -> None:
    """Alone or batched beside other rows (greedy ones included), a row gets the same token, and its
    generator advances by exactly one float64 uniform; a greedy row's generator does not move."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(7)) * 2
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.3, 0.0])
    top_k = torch.tensor([0, 0, 20, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0])

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(5)]

    batch_generators = generators()
    batched = choose_tokens(logits, temperature, top_k, top_p, batch_generators)
    rows = [slice(i, i + 1) for i in range(5)]
    alone = [
        int(choose_tokens(logits[r], temperature[r], top_k[r], top_p[r], [g])[0])
        for r, g in zip(rows, generators(), strict=True)
    ]
    assert batched.tolist() == alone
    for i, g in enumerate(batch_generators):
        reference = torch.Generator().manual_seed(100 + i)
        if temperature[i] > 0:
            torch.rand((), generator=reference, dtype=torch.float64)
        assert torch.equal(g.get_state(), reference.get_state()), f"row {i}"
    greedy = logits.argmax(-1)
    assert batched[1] == greedy[1] and batched[4] == greedy[4]


def test_rows_without_a_generator_or_temperature_are_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    ones, zeros = torch.ones(3), torch.zeros(3)
    no_k = torch.zeros(3, dtype=torch.long)
    assert choose_tokens(logits, ones, no_k, ones, [None, None, None]).tolist() == logits.argmax(-1).tolist()
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert choose_tokens(logits, zeros, no_k, ones, gens).tolist() == logits.argmax(-1).tolist()


def test_inverse_cdf_picks_the_entry_whose_interval_holds_the_uniform_and_never_a_zero() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(6, -1)
    below_one = math.nextafter(1.0, 0.0)
    uniforms = torch.tensor([0.0, 0.1, 0.25, 0.26, 0.99, below_one], dtype=torch.float64)
    # [0, 0.25) -> entry 1; [0.25, 1) -> entry 3 (0.25 itself begins entry 3's interval)
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 3, 3]
    # unnormalised rows scale the target by their own total; a trailing run of zeros is never reached
    tail = torch.tensor([[2.0, 2.0, 0.0, 0.0], [1e-30, 1.0, 0.0, 0.0]])
    assert inverse_cdf(tail, torch.tensor([below_one, below_one], dtype=torch.float64)).tolist() == [1, 1]
