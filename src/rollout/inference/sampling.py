"""Token selection for a batch of rows that each have their own sampling params and RNG.

    tokens = choose_tokens(logits, temperature, top_k, top_p, generators)

Sampling uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1) is a
draw from p): every sampling row draws exactly `vocab` exponentials per step
from its *own* `torch.Generator`, in vocabulary order. A row's tokens so depend
only on its seed and its logits, never on which other rows share the batch or
where it sits in it; that is what makes "same seed, same completion, batched
or alone" hold. Greedy rows (temperature 0) take the argmax and draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The next token of each row. logits: (rows, vocab) float32; the rest are per-row (rows,).

    Filtering order is temperature, then top-k (`top_k <= 0` keeps all), then
    top-p over what top-k kept (the smallest set of most likely tokens whose
    mass reaches `top_p`; the most likely token always survives).
    """
    greedy_tokens = logits.argmax(dim=-1)
    sampling = temperature > 0
    if not bool(sampling.any()):
        return greedy_tokens
    vocab = logits.shape[-1]
    scaled = logits / torch.where(sampling, temperature, torch.ones_like(temperature)).unsqueeze(-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.stack(
        [
            torch.empty(vocab, device=logits.device).exponential_(generator=g)
            if g is not None and is_sampling
            else torch.ones(vocab, device=logits.device)
            for g, is_sampling in zip(generators, sampling.tolist(), strict=True)
        ]
    )
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(sampling, sampled, greedy_tokens)


def _filter_top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(-1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
