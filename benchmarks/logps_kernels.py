"""Log-prob kernels on the CPU: rollout's `target_logps` and per-token entropy against the formulas
they replaced, on ordinary and on peaked rows (interleaved, same process, same tensors).

    .venv/bin/python benchmarks/logps_kernels.py                 # ~20 s on 2 cores
    .venv/bin/python benchmarks/logps_kernels.py --threads 2 --rows 2048 --vocab 4096

Why: torch's CPU `exp` takes a slow path for inputs below ~-87 (where float32 exp underflows):
`torch.full((95, 512), -90.).exp()` takes ~35x as long as at -50. A trained policy is peaked --
most of its vocabulary sits far below the max logit -- so formulas that exponentiate log-probs or
`logits - max` pay it, and `torch.logsumexp` on the CPU is such a formula (unfused: amax, sub, exp,
sum, log; its backward exponentiates again), while the fused `log_softmax` / `softmax` kernels
are not affected.

  target_logps   log p(target) of [rows, vocab] logits, forward + backward:
                 old `logit[target] - logsumexp(logits)` vs `rollout.losses.logps.target_logps`
                 (the picked entries of `log_softmax`; backward onehot - softmax)
  entropy        -sum p log p per row from `log_softmax` output, forward only (no grad):
                 old `logp.exp()` vs `softmax(logits)` (`rollout.models.prefix.prefix_logps`)

"peaked" rows are N(0, 1) logits times `--peak` (default 30: ~half of each row's log-probs
below -87, like the SFT-warmed tiny model's); "flat" rows are N(0, 1). Prints the median
microseconds of each and old / new (higher is better for rollout).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rollout.losses.logps import target_logps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=600, help="token rows (default 600)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512: the tiny model's)")
    p.add_argument("--peak", type=float, default=30.0, help="logit scale of the peaked rows (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per variant (default 200)")
    return p.parse_args(argv)


def old_target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def old_entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def new_entropy(logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(logits, -1) * logp).sum(-1)


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each, the calls interleaved (A B A B ...)."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"log-prob kernels, {args.rows} x {args.vocab} float32 logits, {args.threads} thread(s), "
          f"torch {torch.__version__}; median of {args.repeats} interleaved calls")
    print(f"{'kernel':<14} {'rows':<7} {'old us':>9} {'new us':>9} {'old/new':>8}  max |old - new|")
    targets = torch.randint(0, args.vocab, (args.rows,))
    weights = torch.randn(args.rows)
    for label, scale in (("flat", 1.0), ("peaked", args.peak)):
        logits = (torch.randn(args.rows, args.vocab) * scale).requires_grad_()
        below = float((F.log_softmax(logits.detach(), -1) < -87).float().mean())

        def fwd_bwd(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor = logits) -> None:
            torch.autograd.grad((fn(x, targets) * weights).sum(), x)

        t = timed({"old": lambda: fwd_bwd(old_target_logps), "new": lambda: fwd_bwd(target_logps)}, args.repeats)
        with torch.no_grad():
            diff = float((old_target_logps(logits, targets) - target_logps(logits, targets)).abs().max())
        print(f"{'target_logps':<14} {label:<7} {t['old'] * 1e6:9.0f} {t['new'] * 1e6:9.0f} "
              f"{t['old'] / t['new']:7.2f}x  {diff:.1e}  ({below:.0%} of log-probs < -87)")

        with torch.no_grad():
            x = logits.detach()
            logp = F.log_softmax(x, -1)
            entropy = {"old": functools.partial(old_entropy, logp),
                       "new": functools.partial(new_entropy, x, logp)}
            t = timed(entropy, args.repeats)
            diff = float((entropy["old"]() - entropy["new"]()).abs().max())
        print(f"{'entropy':<14} {label:<7} {t['old'] * 1e6:9.0f} {t['new'] * 1e6:9.0f} "
              f"{t['old'] / t['new']:7.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
