"""The two layouts of shared-prompt log-probs, timed side by side (forward + backward, CPU).

    .venv/bin/python benchmarks/prefix_layout.py                 # ~1 minute: 1 thread, 60 interleaved pairs per shape
    .venv/bin/python benchmarks/prefix_layout.py --threads 2 --model mid
    .venv/bin/python benchmarks/prefix_layout.py --calibrate 24   # fit the second call's cost, ~2 minutes

`rollout.models.prefix.prefix_logps` runs a batch of completions over shared prompts in one of
two layouts: *cache* (the distinct prompts once, their key/value cache gathered to each row, the
completions right-padded to the longest on top: two forward calls) or *packed* (each prompt
followed by all its completions in one row, a 4D mask keeping the completions apart: one call,
no padding inside a group). `packed_layout` picks by estimated FLOPs; here both are forced on
the same batches and timed alternately (forward, the loss's backward, `zero_grad`), and the
script checks that they agree (log-probs within 1e-4) and prints which one the cost model picks.

Shapes (token ids random, seed 0, on the random tiny Qwen2 or a bigger one from
`bench_common.MODEL_SIZES`):
  grpo   2 prompts of 10-13 tokens x 8 completions of 1-8 tokens (`grpo_step.py`'s step)
  dpo    16 prompts of 12-20 tokens x (chosen, rejected) of 3-6 tokens (`dpo_throughput.py`'s)
  grpo-8 2 prompts of 15 tokens x 8 completions of 8 tokens (an early GRPO step: every completion
         runs to max_tokens)
  long   1 prompt of 200 tokens x 8 completions of 100-128 tokens (the cache layout's case)

`--calibrate N` times N random shapes instead (1-16 prompts x 2-16 completions, prompts of
12-200 tokens, completions of 4-128, drawn near where the cost model's two estimates meet), 8
interleaved pairs each, and fits time = a * FLOP cost + b * (second call) + c over both layouts:
b / a is what the cache layout's second forward call costs in tokens of projections, the figure
`prefix.call_tokens` stands for (`CALL_TOKENS` + `CALL_DISPATCH` / h^2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import MODEL_SIZES  # noqa: E402

SHAPES = {  # name: (prompts, completions per prompt, prompt length range, completion length range)
    "grpo": (2, 8, (10, 13), (1, 8)),
    "dpo": (16, 2, (12, 20), (3, 6)),
    "grpo-8": (2, 8, (15, 15), (8, 8)),
    "long": (1, 8, (200, 200), (100, 128)),
}


def make_batch(shape: str, vocab: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from rollout.models.prefix import collate_prefix

    n_prompts, n, (p_lo, p_hi), (c_lo, c_hi) = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(5, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts, completions = [], []
    for _ in range(n_prompts):
        prompt = ids(p_lo, p_hi)
        for _ in range(n):
            prompts.append(prompt)
            completions.append(ids(c_lo, c_hi))
    return collate_prefix(prompts, completions, 0)


def timed_step(model, batch, layout) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Seconds of one forward + backward in the given layout (None: the cache), and the log-probs."""
    from rollout.models import prefix

    prefix.packed_layout = lambda *a, **k: layout  # type: ignore[assignment]
    t0 = time.perf_counter()
    logps, _ = prefix.prefix_logps(model, batch, with_entropy=True)
    logps.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, logps.detach()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=60, help="timed (cache, packed) pairs per shape (default 60)")
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--calibrate", type=int, default=0, metavar="N", help="fit the second call's cost on N random shapes")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from rollout.models import prefix
    from rollout.models.tiny import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model", **MODEL_SIZES[args.model])
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").train()
    chosen_by_cost = prefix.packed_layout
    if args.calibrate:
        calibrate(model, args.calibrate, args.threads)
        return 0
    n_params = sum(t.numel() for t in model.parameters())
    print(f"prefix layouts, forward + backward: {args.model} Qwen2 ({n_params / 1e6:.2f}M params), "
          f"{args.threads} thread(s), torch {torch.__version__}, median of {args.pairs} interleaved pairs")
    print(f"{'shape':6} | {'rows':>4} | {'cache tokens':>12} | {'packed tokens':>13} | {'cache ms':>8} | "
          f"{'packed ms':>9} | {'cache/packed':>12} | picked")
    for shape in args.shapes.split(","):
        batch = make_batch(shape, model.config.vocab_size)
        picked = "packed" if chosen_by_cost(batch, model.config) is not None else "cache"
        layouts = {name: prefix.packed_layout(batch, model.config, force=name == "packed") for name in ("cache", "packed")}

        try:
            (_, a), (_, b) = timed_step(model, batch, layouts["cache"]), timed_step(model, batch, layouts["packed"])
            if not torch.allclose(a, b, atol=1e-4):
                raise SystemExit(f"{shape}: the layouts disagree by {float((a - b).abs().max()):.2e}")
            for _ in range(5):
                timed_step(model, batch, layouts["cache"]), timed_step(model, batch, layouts["packed"])
            times: dict[str, list[float]] = {"cache": [], "packed": []}
            for i in range(args.pairs):
                for name in ("cache", "packed") if i % 2 == 0 else ("packed", "cache"):
                    times[name].append(timed_step(model, batch, layouts[name])[0])
        finally:
            prefix.packed_layout = chosen_by_cost
        cache_ms, packed_ms = (statistics.median(times[n]) * 1e3 for n in ("cache", "packed"))
        cache_tokens = batch.prompt_ids.numel() + batch.completion_ids.numel()
        packed_tokens = layouts["packed"].input_ids.numel()
        print(f"{shape:6} | {batch.num_rows:>4} | {cache_tokens:>12} | {packed_tokens:>13} | {cache_ms:>8.2f} | "
              f"{packed_ms:>9.2f} | {cache_ms / packed_ms:>11.2f}x | {picked}")
    return 0


def calibrate(model, shapes: int, threads: int) -> None:  # type: ignore[no-untyped-def]
    """Fit the cache layout's second call in tokens (see the module docstring)."""
    import random

    import numpy as np

    from rollout.models import prefix
    from rollout.models.prefix import collate_prefix

    chosen_by_cost = prefix.packed_layout
    rng, h, vocab = random.Random(0), int(model.config.hidden_size), model.config.vocab_size
    rows, times = [], []
    while len(rows) < shapes:
        n_prompts, n = rng.choice([1, 2, 4, 8, 16]), rng.choice([2, 3, 4, 8, 16])
        lp, lc = rng.choice([12, 16, 24, 32, 64, 128, 200]), rng.choice([4, 6, 8, 16, 32, 64, 128])
        if n_prompts * n > 64 or n_prompts * (lp + n * lc) > 2500:
            continue
        width = lp + n * lc
        cache_flops = prefix.forward_cost(model.config, n_prompts * width, n_prompts * (lp * lp + n * lc * (lp + lc)))
        packed_flops = prefix.forward_cost(model.config, n_prompts * width, n_prompts * width * width)
        if not 0.6 < packed_flops / cache_flops < 1.6:
            continue  # far from the boundary: the choice is clear whatever a call costs
        prompts, completions = [], []
        for _ in range(n_prompts):
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(max(1, lp - 4), lp))]
            for _ in range(n):
                prompts.append(prompt)
                completions.append([rng.randrange(5, vocab) for _ in range(rng.randint(max(1, lc // 2), lc))])
        batch = collate_prefix(prompts, completions, 0)
        layouts = {name: chosen_by_cost(batch, model.config, force=name == "packed") for name in ("cache", "packed")}
        if layouts["packed"] is None:
            continue
        measured: dict[str, list[float]] = {"cache": [], "packed": []}
        try:
            for i in range(10):
                for name in ("cache", "packed") if i % 2 == 0 else ("packed", "cache"):
                    seconds = timed_step(model, batch, layouts[name])[0]
                    if i >= 2:
                        measured[name].append(seconds)
        finally:
            prefix.packed_layout = chosen_by_cost
        (p_, lp_), (b_, lc_) = batch.prompt_ids.shape, batch.completion_ids.shape
        w_ = layouts["packed"].input_ids.shape[1]
        # the FLOP estimates without the second call's price, which is what is fitted
        rows.append([prefix.forward_cost(model.config, p_ * lp_ + b_ * lc_, p_ * lp_ * lp_ + b_ * lc_ * (lp_ + lc_)), 1, 1])
        rows.append([prefix.forward_cost(model.config, p_ * w_, p_ * w_ * w_), 0, 1])
        times += [statistics.median(measured["cache"]), statistics.median(measured["packed"])]
        print(f"  {p_:2d} prompts x {lp_:3d}, {b_:2d} rows x {lc_:3d}, packed width {w_:4d}: "
              f"cache {times[-2] * 1e3:7.2f} ms, packed {times[-1] * 1e3:7.2f} ms", flush=True)
    x, y = np.array(rows, dtype=float), np.array(times)
    (a, b, c), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)  # relative error
    error = np.abs(x @ np.array([a, b, c]) - y) / y
    print(f"fit over {shapes} shapes, {threads} thread(s), h = {h}: the second call costs {b * 1e3:.1f} ms = "
          f"{b / a / (6 * h):.0f} tokens (call_tokens here: {prefix.call_tokens(model.config)}); "
          f"fixed {c * 1e3:.1f} ms; error median {np.median(error):.1%}, max {error.max():.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
