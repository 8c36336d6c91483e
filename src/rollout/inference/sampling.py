"""Token selection for a batch of rows that each have their own sampling params and RNG.

    tokens = choose_tokens(logits, temperature, top_k, top_p, generators)

Sampling is by inverse CDF: every sampling row draws exactly one float64 uniform
`u` per step from its *own* `torch.Generator`, and takes the first token, in
vocabulary order, whose cumulative probability (summed in float64) exceeds
`u` times the row's total. A row's tokens so depend only on its seed and its
logits, never on which other rows share the batch or where it sits in it; that
is what makes "same seed, same completion, batched or alone" hold. Greedy rows
(temperature 0) take the argmax and draw nothing.

One uniform a row rather than one random number a vocabulary entry (the
exponential race, argmax p_i / E_i, used before): torch's CPU `exponential_`
costs ~25 ns an element, 3.9 ms a row a step at a 151,936-token vocabulary,
where this whole draw takes ~0.35 ms (benchmarks/README.md, "Sampling by
inverse CDF").

On a GPU the per-row parameters and generators stay on the CPU: the decisions that read them
(which rows draw, whether any filter applies) need no read-back from the device, the uniforms are
drawn on the host, and one copy a step takes them to the device (not a one-element `torch.rand`
launch a row and a `stack`); every copy to the device is non-blocking (from pageable memory
the driver stages it at once).
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
    """The next token of each row. logits: (rows, vocab) float32; the rest are per-row (rows,), on
    the CPU or on the logits' device (then each is read back once); the generators on the CPU (one
    on the device works, its uniform read back row by row).

    Filtering order is temperature, then top-k (`top_k <= 0` keeps all), then
    top-p over what top-k kept (the smallest set of most likely tokens whose
    mass reaches `top_p`; the most likely token always survives). A row with
    no generator is greedy whatever its temperature.
    """
    device = logits.device
    temperature, top_k, top_p = temperature.cpu(), top_k.cpu(), top_p.cpu()
    temperatures = temperature.tolist()
    drawing = [g is not None and t > 0 for g, t in zip(generators, temperatures, strict=True)]
    if not any(drawing):
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    sampling = torch.tensor(drawing)
    if all(t == 1.0 or not draw for t, draw in zip(temperatures, drawing, strict=True)):
        scaled = logits  # dividing by 1 changes no bit
    else:
        divisor = torch.where(sampling, temperature, torch.ones_like(temperature))
        scaled = logits / _to(divisor, device).unsqueeze(-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, _to(k, device), _to(top_p, device))
    uniforms = torch.tensor([
        torch.rand((), generator=g, dtype=torch.float64, device=g.device).item() if draw else 0.0
        for g, draw in zip(generators, drawing, strict=True)
    ], dtype=torch.float64)
    sampled = inverse_cdf(scaled.softmax(dim=-1), _to(uniforms, device))
    return sampled if all(drawing) else torch.where(_to(sampling, device), sampled, logits.argmax(dim=-1))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: a CPU tensor's copy to a GPU does not wait for the device's queue."""
    return t if t.device == device else t.to(device, non_blocking=True)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose float64 cumulative sum of `probs` exceeds `uniforms` x the row total.

    probs: (rows, vocab), non-negative; uniforms: (rows,) in [0, 1). A zero-probability
    entry is never chosen: the target is kept strictly below the total, and an entry
    that adds nothing cannot be the first to pass it.
    """
    # float64: float32 sums would misweigh the small entries of a big vocabulary; in place: one
    # float64 buffer rather than two (at 16 x 151,936 that halved the draw's time)
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(-1) * total, total.nextafter(torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)  # only a row of NaNs (a broken model) reaches past the end


def _filter_top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(-1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
