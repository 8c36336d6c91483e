"""Training's matrix products on the CPU: `F.linear` (MKL's sgemm) against oneDNN's, one process.

    .venv/bin/python benchmarks/cpu_linear.py                 # tiny model, 16 x 64 tokens, 1 thread, ~1 min
    .venv/bin/python benchmarks/cpu_linear.py --threads 2
    .venv/bin/python benchmarks/cpu_linear.py --model mid --rows 8

torch's CPU build sends a float32 `F.linear` to MKL. oneDNN (`torch.ops.mkldnn._linear_pointwise`,
what the hf engine's prepacked decode products use) is also in the build, and on some CPUs its
products are much faster: on an AMD EPYC VM with AVX-512 (2026-11-28) a [496, 128] x [128, 1024]
product took 0.53 ms through oneDNN against 1.24 ms through `F.linear`, one thread; on an AMD EPYC
VM without AVX-512 (also 2026-11-28) it was the other way: a tiny-model training step 0.82x at one
thread and 0.79x at two, the forward products 0.89-1.04x at 1024 rows. rollout's
training passes multiply through `F.linear` unless `[backend] cpu_matmul = "onednn"`
(`rollout.models.cpu_matmul`). This script measures what oneDNN gives on this CPU, outside rollout's
loop:

  (1) products: the model's weight shapes against `--rows` x `--len` activation rows, `F.linear`
      vs oneDNN with the weight as it is vs oneDNN with a prepacked weight (forward only);
  (2) a training step: `lean_hidden_states` + LM head + cross-entropy, forward and backward, with
      every product through `F.linear` or (`rollout.models.cpu_matmul`, `"onednn"`) through oneDNN
      in the forward and both backward products (input and weight gradients); interleaved, medians.
      Also printed: whether the losses are the same bits, and the largest gradient difference.

The two libraries sum in different orders, so the trained bits differ in the last places (as on
another CPU); which is faster depends on the CPU and the thread count (measure both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import MODEL_SIZES

onednn = torch.ops.mkldnn._linear_pointwise


def median_ms(fn: any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def products(model: any, tokens: int, reps: int) -> None:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"(1) products, {tokens} activation rows, forward only, median ms of {reps}")
    print(f"{'weight [out, in]':>18} | {'F.linear':>9} | {'oneDNN':>9} | {'prepacked':>9} | F.linear / oneDNN")
    for out_f, in_f in shapes:
        w, x = torch.randn(out_f, in_f), torch.randn(tokens, in_f)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
        a = median_ms(lambda: F.linear(x, w), reps)  # noqa: B023
        b = median_ms(lambda: onednn(x, w, None, "none", [], ""), reps)  # noqa: B023
        c = median_ms(lambda: onednn(x, packed, None, "none", [], ""), reps)  # noqa: B023
        print(f"{str([out_f, in_f]):>18} | {a:9.3f} | {b:9.3f} | {c:9.3f} | {a / b:.2f}x")


def training_step(model: any, rows: int, length: int, steps: int) -> None:
    """`lean_hidden_states` + LM head + cross-entropy, forward and backward, under each setting."""
    from rollout.models import cpu_matmul
    from rollout.models.lean_decoder import lean_hidden_states

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=g)
    positions = torch.arange(length).expand(rows, length)
    mask = torch.ones(rows, length, dtype=torch.long)

    def step(kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        cpu_matmul.set_cpu_matmul(kind)
        try:
            hidden = lean_hidden_states(model, ids, positions, mask)
            assert hidden is not None, "the lean forward does not run this model"
            logits = cpu_matmul.project(model.lm_head, hidden[:, :-1])
        finally:
            cpu_matmul.set_cpu_matmul("torch")
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss_a, grads_a = step("torch")
    loss_b, grads_b = step("onednn")
    diff = max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b, strict=True))
    scale = max(float(a.abs().max()) for a in grads_a)
    times: dict[str, list[float]] = {"torch": [], "onednn": []}
    for i in range(steps):
        for kind in ("torch", "onednn") if i % 2 == 0 else ("onednn", "torch"):
            t0 = time.perf_counter()
            step(kind)
            times[kind].append(time.perf_counter() - t0)
    a, b = statistics.median(times["torch"]) * 1e3, statistics.median(times["onednn"]) * 1e3
    print(f"\n(2) training step, {rows} x {length} tokens, forward + backward, median of {steps} interleaved")
    print(f"F.linear {a:.2f} ms, oneDNN {b:.2f} ms: {a / b:.2f}x; loss {float(loss_a):.7f} vs {float(loss_b):.7f}"
          f" ({'the same bits' if torch.equal(loss_a, loss_b) else 'other bits'}); largest gradient difference"
          f" {diff:.2e} (largest gradient {scale:.2e})")
    print(verdict(a / b, torch.get_num_threads()))


def verdict(speedup: float, threads: int) -> str:
    """What the training step's ratio says about `[backend] cpu_matmul` on this CPU at this thread count
    (5% either way is within a 2-core VM's noise)."""
    if speedup >= 1.05:
        return (f'on this CPU at {threads} thread(s) oneDNN is {speedup:.2f}x: [backend] cpu_matmul = "onednn" '
                "should train faster here (check with your own shapes: --model, --rows, --len)")
    if speedup <= 0.95:
        return f'on this CPU at {threads} thread(s) oneDNN is {speedup:.2f}x: keep the default cpu_matmul = "torch"'
    return f"on this CPU at {threads} thread(s) the two are within 5% ({speedup:.2f}x): keep the default"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                return line.split(":", 1)[1].strip() + (" (AVX-512)" if "avx512f" in flags else "")
    except OSError:
        pass
    return "CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--model", choices=("tiny", "mid"), default="tiny", help="model size (default tiny)")
    p.add_argument("--rows", type=int, default=16, help="rows per training step (default 16)")
    p.add_argument("--len", type=int, default=64, help="tokens per row (default 64)")
    p.add_argument("--steps", type=int, default=60, help="interleaved training steps per side (default 60)")
    args = p.parse_args(argv)
    if args.len < 2 or min(args.threads, args.rows, args.steps) < 1:
        p.error("--len must be >= 2 (the step predicts each next token); --threads, --rows and --steps >= 1")
    from rollout.models import cpu_matmul

    if not cpu_matmul.available():
        print("this torch build has no oneDNN linear", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from rollout.models.tiny import init_tiny_model

    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"{torch.__config__.show().splitlines()[3].strip().lstrip('- ')}")
    with tempfile.TemporaryDirectory(prefix="cpu-linear-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model", **MODEL_SIZES[args.model])
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    model.train()
    products(model, args.rows * args.len, reps=max(20, args.steps))
    training_step(model, args.rows, args.len, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
