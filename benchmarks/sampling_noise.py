"""Token selection per decode step: rollout's `choose_tokens` against the exponential race and `multinomial`.

    .venv/bin/python benchmarks/sampling_noise.py                        # 16 rows; vocab 512, 32,000, 151,936
    .venv/bin/python benchmarks/sampling_noise.py --rows 64 --threads 2

Three ways to pick one token a row from (rows, vocab) float32 logits at temperature 1:

- **rollout**: `rollout.inference.sampling.choose_tokens`. Each row draws one float64
  uniform from its own generator and takes the first token whose float64 cumulative
  probability passes it (inverse CDF): a row's token does not depend on its batch.
- **race**: what `choose_tokens` did until 2026-11-28, and what vLLM's sampler does: the
  exponential race, argmax p_i / E_i with `vocab` exponentials drawn for each row from
  the row's own generator (batch invariant too).
- **multinomial**: transformers' `generate` (`softmax` then `torch.multinomial(probs, 1)`
  on the whole batch with the global generator): one call, but a row's token depends on
  the rows before it in the batch.

The same logits for all three; each timed over `--calls` calls, the three interleaved
`--repeats` times, medians printed with the ratios race / rollout and multinomial / rollout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from rollout.inference.sampling import choose_tokens


def race(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=g) for g in generators])
    return (probs / noise).argmax(dim=-1)


def multinomial(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", default="512,32000,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=0, help="calls a timing (default: ~0.3 s of the slowest)")
    args = parser.parse_args()
    if args.rows < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1")
    try:
        vocabs = [int(v) for v in args.vocab.split(",")]
    except ValueError:
        parser.error(f"--vocab: comma-separated integers, got {args.vocab!r}")
    if any(v < 2 for v in vocabs):
        parser.error("--vocab: sizes must be >= 2")
    torch.set_num_threads(args.threads)
    print(f"rows {args.rows}, {args.threads} thread(s), temperature 1, no top-k/top-p; ms a call, median of {args.repeats}")
    print(f"{'vocab':>8} {'rollout':>9} {'race':>9} {'multinomial':>12} {'race/rollout':>13} {'multinomial/rollout':>20}")
    for vocab in vocabs:
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
        temperature, top_p = torch.ones(args.rows), torch.ones(args.rows)
        top_k = torch.zeros(args.rows, dtype=torch.long)
        rows = [torch.Generator().manual_seed(i) for i in range(args.rows)]
        shared = torch.Generator().manual_seed(0)
        ways = {
            "rollout": partial(choose_tokens, logits, temperature, top_k, top_p, rows),
            "race": partial(race, logits, rows),
            "multinomial": partial(multinomial, logits, shared),
        }
        for way in ways.values():
            way()  # warm-up
        calls = args.calls or max(3, int(0.3 / max(_time(ways["race"], 1), 1e-6)))
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                times[name].append(_time(way, calls) * 1e3)
        med = {name: statistics.median(values) for name, values in times.items()}
        print(f"{vocab:>8} {med['rollout']:>9.3f} {med['race']:>9.3f} {med['multinomial']:>12.3f}"
              f" {med['race'] / med['rollout']:>12.2f}x {med['multinomial'] / med['rollout']:>19.2f}x")  # fmt: skip


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()
