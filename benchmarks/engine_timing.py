"""Decode throughput of the hf engine alone, for A/B runs of two checkouts side by side.

    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/engine_timing.py --model mid   # the other tree
    .venv/bin/python benchmarks/engine_timing.py --model mid --device cuda --dtype bfloat16

Makes (or reuses, under `--work-dir`) a random Qwen2 of `bench_common.MODEL_SIZES`, loads it with
`load_hf_engine`, and times `--repeats` calls of `HFEngine.generate` on `--prompts` prompts x
`--max-tokens` sampled tokens (temperature 1, eos ignored, seed 0, so every call makes the same
tokens), after one warm-up call. Prints one line: the rollout package it imported, tokens/s
median [min-max]. Run it alternately under each checkout's `PYTHONPATH` (one process each: the
two trees cannot share an interpreter) and compare the medians; `gpu.sh` does that on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_common import MODEL_SIZES, add_precision_args
from generation import make_model, make_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(MODEL_SIZES), default="mid")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--work-dir", type=Path, default=Path("local/bench-generation"), help="model cache folder")
    add_precision_args(p)
    args = p.parse_args(argv)
    if min(args.prompts, args.max_tokens, args.repeats) < 1:
        p.error("--prompts, --max-tokens and --repeats must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    import rollout
    from rollout.inference import SamplingParams
    from rollout.inference.hf_engine import load_hf_engine

    torch.set_num_threads(args.threads)
    model_dir = make_model(args.work_dir, args.model)
    engine = load_hf_engine(model_dir, dtype=args.dtype, device=args.device, max_batch_size=max(32, args.prompts))
    prompts = make_prompts(args.prompts)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        rates.append(sum(c.completion_tokens for cs in results for c in cs) / seconds)
    where = Path(rollout.__file__).resolve().parent.parent
    print(
        f"engine {args.model} {args.device} {args.dtype} {args.prompts}x{args.max_tokens} ({where}): "
        f"{statistics.median(rates):.1f} tok/s [{min(rates):.1f}-{max(rates):.1f}]",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
