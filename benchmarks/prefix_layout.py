"""The two layouts of shared-prompt log-probs, timed side by side (forward + backward, CPU).

    .venv/bin/python benchmarks/prefix_layout.py                 # ~1 minute: 1 thread, 60 interleaved pairs per shape
    .venv/bin/python benchmarks/prefix_layout.py --threads 2 --model mid

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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from rollout.models import prefix
    from rollout.models.tiny import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model", **MODEL_SIZES[args.model])
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").train()
    chosen_by_cost = prefix.packed_layout
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


if __name__ == "__main__":
    raise SystemExit(main())
