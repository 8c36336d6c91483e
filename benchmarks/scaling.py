"""Rollout throughput with Ray rollout workers (`[distributed] kind = "ray"`): samples/s for 1, 2
and 4 workers, and a static split against work stealing when one worker is 3x slower.

    PYTHONPATH=src python benchmarks/scaling.py                 # ~3 minutes on two cores
    PYTHONPATH=src python benchmarks/scaling.py --rounds 2 --prompts 16

What it measures: the RL rollout side alone (no training step), as GRPO drives it: a
`RolloutManager` asks for batches of `--prompts` prompt groups x `--generations` samples of the
tiny model (`--max-tokens` tokens, temperature 1), scored by `arithmetic_correct`; the groups are
made by `RayRollout` workers (one torch thread each) on a local Ray cluster this script starts
(`ray.init(num_cpus=4)`), and by the in-process engine for the `local` row. Each row times
`--rounds` batches after one warm-up batch (workers load weights, first calls); samples/s = samples
/ wall seconds. The slow worker (id 1) sleeps twice as long as each of its leases took, so it
makes groups at a third of the speed of the others.

"static" hands every worker an equal share of each batch up front (what a fixed split of the
prompts across workers does); "steal" is the shared queue: a worker takes its next lease the
moment it returns one. The acceptance figure is steal / static with the slow worker, >= 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _manager(data, sampler, runner, args):
    from rollout.inference.types import SamplingParams
    from rollout.rl.buffer import DataBuffer
    from rollout.rl.manager import GroupSpec, RolloutManager
    from rollout.rl.rewards import resolve_reward

    return RolloutManager(
        sampler, data, DataBuffer(len(data), seed=0), reward_fns=[("correct", resolve_reward("arithmetic_correct"), 1.0)],
        group=GroupSpec(args.generations, SamplingParams(temperature=1.0, max_tokens=args.max_tokens), seed=0),
        prompts_per_batch=args.prompts, group_runner=runner,
    )


def _time_batches(manager, rounds: int) -> tuple[float, int]:
    """Samples/s over `rounds` batches after a warm-up batch, and the samples made."""

    async def go() -> tuple[float, int]:
        await manager.next_batch(0)
        started, samples = time.perf_counter(), 0
        for _ in range(rounds):
            samples += len((await manager.next_batch(0)).samples)
        return samples / (time.perf_counter() - started), samples

    return asyncio.run(go())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed batches per row (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=32, help="prompt groups per batch")
    parser.add_argument("--generations", type=int, default=8, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workers", default="1,2,4", help="worker counts for the scaling rows")
    args = parser.parse_args()

    import ray
    import torch
    from safetensors.torch import load_file

    from rollout.algorithms.rl_common import build_engine
    from rollout.inference.types import SamplingParams
    from rollout.models.load import ModelSource
    from rollout.models.tiny import init_tiny_model
    from rollout.rl.manager import GroupSpec
    from rollout.rl.ray_rollout import RayRollout, WorkerSpec
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="rollout-scaling-"))
    model_dir = init_tiny_model(root / "tiny")
    prompts = write_arithmetic_dataset(root / "arith")["prompts"]
    data = [json.loads(line) for line in Path(prompts).read_text().splitlines() if line.strip()]
    model = ModelSource(uri=str(model_dir))
    group = GroupSpec(args.generations, SamplingParams(temperature=1.0, max_tokens=args.max_tokens), 0)
    spec = WorkerSpec(model=model, group=group, rewards=[_reward_entry()], env=None, num_threads=1)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    cpus = os.cpu_count()
    print(f"tiny model, {args.prompts} groups x {args.generations} samples x <= {args.max_tokens} tokens per batch,"
          f" {args.rounds} timed batches per row, {cpus} CPU cores, 1 torch thread per engine", flush=True)

    results: list[tuple[str, float]] = []
    engine = build_engine(model, inference=None, device=torch.device("cpu"), weights_dir=root / "weights")
    try:
        rate, _ = _time_batches(_manager(data, engine.sampler, None, args), args.rounds)
    finally:
        engine.close()
    results.append(("local (in-process engine)", rate))
    print(f"  local: {rate:.1f} samples/s", flush=True)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        def row(label: str, n: int, schedule: str = "steal", slow: dict[int, float] | None = None) -> float:
            runner = RayRollout(WorkerSpec(**{**spec.__dict__, "slowdown": slow or {}}), num_workers=n,
                                schedule=schedule, name=f"scaling-{len(results)}")  # type: ignore[arg-type]
            try:
                runner.push(weights, version=0)
                rate, _ = _time_batches(_manager(data, None, runner, args), args.rounds)
            finally:
                runner.close()
            results.append((label, rate))
            print(f"  {label}: {rate:.1f} samples/s", flush=True)
            return rate

        for n in (int(x) for x in args.workers.split(",") if x):
            row(f"ray, {n} worker{'s' if n > 1 else ''}", n)
        static = row("ray, 2 workers, worker 1 3x slower, static split", 2, "static", {1: 3.0})
        steal = row("ray, 2 workers, worker 1 3x slower, work stealing", 2, "steal", {1: 3.0})
    finally:
        ray.shutdown()

    width = max(len(label) for label, _ in results)
    print(f"\n{'configuration':<{width}}  samples/s")
    for label, rate in results:
        print(f"{label:<{width}}  {rate:9.1f}")
    print(f"\nwork stealing / static split with one 3x slower worker: {steal / static:.2f}x")
    return 0


def _reward_entry():
    from rollout.algorithms.config import RewardSpec

    return RewardSpec(name="arithmetic_correct")


if __name__ == "__main__":
    sys.exit(main())
