"""Where a step's time goes on CUDA: torch.profiler over rollout and TRL, same settings as gpu.sh's runs.

    python3 benchmarks/gpu_profile.py --job grpo --out local/gpu-profile    # on a lent GPU (benchmarks/gpu.sh)

Runs each library's run function from grpo_step.py / sft_throughput.py (a short run, bf16,
the large model) under `torch.profiler`, then prints per step: the host-side time of the top
operators (self CPU), the device's busy time (self CUDA), and how often the host waited for
the device (`aten::_local_scalar_dense`: `.item()`, `.tolist()`, `bool(tensor)`; and
`cudaStreamSynchronize` / `cudaDeviceSynchronize` calls). A launch-bound step shows device
busy time far under the wall time and many small kernels; a sync-bound one shows many waits.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item")


def profile(name: str, fn, steps: int, out: Path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    table_cpu = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    table_cuda = events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60) if cuda else ""
    (out / f"{name}.txt").write_text(f"wall {wall:.2f}s, {steps} steps\n\n{table_cpu}\n\n{table_cuda}\n")
    by_name = {e.key: e for e in events}
    cuda_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    waits = {k: by_name[k].count / steps for k in SYNC_OPS if k in by_name}
    print(
        f"{name}: wall {wall / steps * 1e3:.1f} ms/step (run incl. load and warm-up: {wall:.1f}s), "
        f"device busy {cuda_total / steps * 1e3:.1f} ms/step, kernels {kernels / steps:.0f}/step, "
        f"host waits per step {', '.join(f'{k} {v:.0f}' for k, v in waits.items())}"
    )
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    for e in top:
        print(f"    {e.key[:58]:<58} self cpu {e.self_cpu_time_total / steps / 1e3:7.2f} ms/step  x{e.count / steps:.0f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", choices=("grpo", "sft"), required=True)
    p.add_argument("--out", type=Path, default=Path("local/gpu-profile"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", default="large")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).parent))
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    common = ["--device", args.device, "--dtype", dtype, "--threads", "4", "--model", args.model]
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as tmp:
        work = Path(tmp)
        if args.job == "grpo":
            import grpo_step as g

            a = g.parse_args(
                [*common, "--prompts", "8", "--generations", "8", "--max-tokens", "32", "--steps", str(args.steps),
                 "--warmup-steps", "1", "--reward-window", "1"]
            )
            model_dir, prompts, _ = g.prepare_inputs(work, a)
            runs = {
                "grpo-rollout": lambda: g.run_rollout(work / "r", model_dir, prompts, a, seed=0, off_policy_steps=0),
                "grpo-trl": lambda: g.run_trl(work / "t", model_dir, prompts, a, seed=0),
            }
        else:
            import sft_throughput as s

            a = s.parse_args(
                [*common, "--data", "mixed", "--batch-size", "32", "--steps", str(max(args.steps, 20)),
                 "--warmup-steps", "1", "--modes", "padded"]
            )
            model_dir, data = s.prepare_inputs(work, "mixed", args.model)
            runs = {
                "sft-padded-rollout": lambda: s.run_rollout(work / "r", model_dir, data, a, packed=False),
                "sft-padded-trl": lambda: s.run_trl(work / "t", model_dir, data, a, packed=False),
            }
        for name, fn in runs.items():
            profile(name, fn, a.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
