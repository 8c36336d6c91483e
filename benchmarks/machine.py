"""Which kind of machine a benchmark table came from: its CPU, vector ISA and caches, and four
one-thread calibration figures that the tables' ratios turn on.

    .venv/bin/python benchmarks/machine.py        # the line `make bench` writes into its table's header

The 2-core VMs these benchmarks run on are of several kinds (benchmarks/README.md compares them:
AMD EPYC with and without AVX-512, Intel Xeon with AVX-512), and the same code gives other ratios on
each: where the small products are slow, every side is bound by the same kernels and a framework's
lower overhead counts for less. The figures, each the median of `REPEATS` timings at one thread:

- `stream`: a float32 `sum` over 192 MB (GB/s): what one core reads from memory;
- `decode_linear` / `decode_onednn`: [16, 640] x [640, 3584] (the 48M model's stacked gate/up
  weight at 16 rows: the engine's decode step) through `F.linear` (what transformers' `generate`
  runs) and through oneDNN's prepacked weight (what the hf engine runs), cycling over 20 weights so
  each is read from memory, as in a decode step (GFLOP/s);
- `train_linear`: [288, 128] x [128, 512] (the tiny model's MLP over a training pass's tokens),
  weight in cache (GFLOP/s).

A decode product of 16 rows is neither the stream's time nor the compute's but close to their sum on
the VMs measured (benchmarks/README.md, "Where the two Intel shortfalls go"); where `decode_onednn`
is far above `decode_linear`, the engine gains on `generate`, and where both are low, neither can.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPEATS = 5
ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "avx2")
"""The flags reported, widest first: what torch's CPU kernels, MKL and oneDNN choose their code by."""


def describe_cpu() -> dict[str, Any]:
    """The CPU's model name, which of `ISA_FLAGS` it has, and its L2 / L3 sizes (Linux; empty elsewhere)."""
    info: dict[str, Any] = {"model": "", "isa": [], "l2": "", "l3": ""}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        info["model"] = model.group(1).strip() if model else ""
        have = set(flags.group(1).split()) if flags else set()
        info["isa"] = [f for f in ISA_FLAGS if f in have]
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    for key in ("l2", "l3"):
        found = re.search(rf"^{key.upper()} cache:\s*(.+)$", lscpu, re.M)
        info[key] = found.group(1).strip() if found else ""
    return info


def calibrate() -> dict[str, float]:
    """The four one-thread figures of the docstring (call it in a process that can set torch's threads)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    stream = torch.randn(48_000_000)
    weights = [torch.randn(3584, 640) for _ in range(20)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights] if _has_onednn() else []
    decode_x, train_x, train_w = torch.randn(16, 640), torch.randn(288, 128), torch.randn(512, 128)

    def per_call(product: Any, calls: int) -> float:
        """Seconds per call of `product(i)`, i = 0..calls-1, after one untimed round of the same calls."""
        for i in range(calls):
            product(i)
        started = time.perf_counter()
        for i in range(calls):
            product(i)
        return (time.perf_counter() - started) / calls

    def median(product: Any, calls: int) -> float:
        return statistics.median(per_call(product, calls) for _ in range(REPEATS))

    def onednn(x: Any, w: Any) -> Any:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    decode_flop, train_flop = 2 * 16 * 640 * 3584, 2 * 288 * 128 * 512
    figures = {
        "stream_gb_s": stream.numel() * 4 / median(lambda i: stream.sum(), 1) / 1e9,
        "decode_linear_gflop_s": decode_flop / median(lambda i: F.linear(decode_x, weights[i]), len(weights)) / 1e9,
        "train_linear_gflop_s": train_flop / median(lambda i: F.linear(train_x, train_w), 200) / 1e9,
    }
    if packed:
        figures["decode_onednn_gflop_s"] = decode_flop / median(lambda i: onednn(decode_x, packed[i]), len(packed)) / 1e9
    return figures


def _has_onednn() -> bool:
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def summary_line(cpu: dict[str, Any], figures: dict[str, float]) -> str:
    """One line for a table's header: what kind of machine, and how fast its kernels run here."""
    isa = ", ".join(cpu["isa"]) or "no AVX2"
    wide = "" if "avx512f" in cpu["isa"] else " (no avx512f)"
    caches = ", ".join(f"{k.upper()} {cpu[k]}" for k in ("l2", "l3") if cpu[k])
    onednn = figures.get("decode_onednn_gflop_s")
    decode = f"F.linear {figures['decode_linear_gflop_s']:.0f}" + (f" / oneDNN {onednn:.0f}" if onednn else "")
    return (f"{cpu['model'] or 'unknown CPU'}: {isa}{wide}; {caches}. One thread: stream "
            f"{figures['stream_gb_s']:.1f} GB/s, a 16-row decode product {decode} GFLOP/s, "
            f"a 288-row training product {figures['train_linear_gflop_s']:.0f} GFLOP/s (`benchmarks/machine.py`).")


def main() -> int:
    cpu, figures = describe_cpu(), calibrate()
    print(summary_line(cpu, figures))
    print(json.dumps({"cpu": cpu, "calibration": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
