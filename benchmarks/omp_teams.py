"""Generation on a second Python thread vs on the training thread: the cost of two OpenMP teams.

    .venv/bin/python benchmarks/omp_teams.py                 # 2 threads: both placements, ~1 minute
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/omp_teams.py
    .venv/bin/python benchmarks/omp_teams.py --threads 1

An on-policy GRPO step, reduced to its two compute phases on the tiny model: the hf engine
generates 2 prompts x n=8 x 8 tokens, then a plain training step (forward, backward, AdamW) on
16 x 24 tokens. rollout's RL loop runs `engine.generate` on the sampler's worker thread and
training on the event loop's thread; with the OpenMP runtime torch uses, each Python thread
that runs a parallel region gets its own team of `--threads` threads, and a team's threads
spin, then sleep, while the other team works. This script times both phases with generation
(a) on the training thread and (b) on a worker thread (a one-thread executor, as rollout's
sampler does), interleaved per step, in one process. Each placement runs in its own
subprocess (OpenMP teams and their threads live for the process). Prints median ms per phase.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--steps", type=int, default=60, help="steps per placement, 10 of them warm-up (default 60)")
    p.add_argument("--model-dir", type=Path, default=None, help="a model folder (default: a fresh tiny model)")
    p.add_argument("--placement", choices=("main", "worker"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_placement(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.inference import SamplingParams
    from rollout.inference.hf_engine import load_hf_engine

    engine = load_hf_engine(args.model_dir, max_batch_size=32)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}],
                                             add_generation_prompt=True, tokenize=False) for a, b in ((5, 1), (8, 7))]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=8, seed=0, ignore_eos=True)
    ids = torch.randint(3, int(model.config.vocab_size), (16, 24), generator=torch.Generator().manual_seed(0))
    worker = concurrent.futures.ThreadPoolExecutor(1)

    def generate() -> None:
        engine.generate(prompts, params)

    def train() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    gen_s, train_s = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        if args.placement == "worker":
            worker.submit(generate).result()
        else:
            generate()
        t1 = time.perf_counter()
        train()
        t2 = time.perf_counter()
        if step >= 10:
            gen_s.append(t1 - t0)
            train_s.append(t2 - t1)
    print(f"{args.placement:<7} {statistics.median(gen_s) * 1e3:10.1f} {statistics.median(train_s) * 1e3:10.1f}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.placement is not None:
        run_placement(args)
        return
    import os

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from rollout.models.tiny import init_tiny_model

            model_dir = init_tiny_model(Path(tmp) / "tiny", force=True)
        print(f"{args.threads} thread(s), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
              "median ms per step")
        print(f"{'gen on':<7} {'generate':>10} {'train':>10}")
        for placement in ("main", "worker"):
            subprocess.run([sys.executable, __file__, "--placement", placement, "--threads", str(args.threads),
                            "--steps", str(args.steps), "--model-dir", str(model_dir)], check=True,
                           stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
