"""Helpers the TRL benchmark scripts share (imported as a sibling module: the
scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def no_activation_checkpointing(config_cls: type) -> dict[str, bool]:
    """TRL configs turn gradient checkpointing on by default; transformers 5 renamed the flag."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {name: False for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}


def prepare_trl_process(*, omp_passive: bool) -> None:
    """What a TRL benchmark script sets before its first torch import: OpenMP's wait policy (read
    when torch loads OpenMP), offline hub, no tokenizer threads, no progress bars or library logs."""
    import os

    if omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()


@dataclasses.dataclass(frozen=True)
class RolloutWindow:
    """A rollout training run's timed window, read back from its embedded store."""

    steps: int  # optimizer steps inside the window (warm-up steps left out)
    seconds: float  # end of the last step - end of the last warm-up step (`train_step` events)
    tokens: int  # `train/tokens_seen` over the window
    final_loss: float  # mean `train/loss` of the last `loss_window` steps


def rollout_window(db: Path, run_id: str, *, warmup_steps: int, steps: int, loss_window: int) -> RolloutWindow:
    """The window of run `run_id` in the embedded store at `db`; asserts it ran all `steps`."""
    import statistics

    from rollout.store import open_store

    store = open_store("embedded", path=db)
    try:
        step_end = {e.fields["step"]: e.time for e in store.read_events(run_id) if e.name == "train_step"}
        seen = {m.step: m.value for m in store.read_metrics(run_id, name="train/tokens_seen")}
        losses = {m.step: m.value for m in store.read_metrics(run_id, name="train/loss")}
    finally:
        store.close()
    first, last = warmup_steps, max(step_end, default=0)
    assert last == steps, f"rollout stopped after {last} of {steps} steps"
    return RolloutWindow(
        steps=last - first, seconds=step_end[last] - step_end[first], tokens=int(seen[last] - seen[first]),
        final_loss=statistics.fmean(losses[s] for s in range(last - loss_window + 1, last + 1)),
    )


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Swallow stderr (progress bars/lines), but show it if the block fails."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise


# Model sizes the scripts can make with `init_tiny_model` (random weights, the tiny tokenizer).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # ~1.05M params: the tiny Qwen2 every CPU figure uses
    "mid": dict(  # ~48M
        hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=5, intermediate_size=1792, vocab_size=2048
    ),
    "large": dict(  # ~190M: enough work per step for a GPU figure to mean something
        hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=2816, vocab_size=2048
    ),
}
# bf16 dense matrix rate of one H100/H200 SXM (datasheet, no sparsity): the MFU denominator on CUDA
PEAK_BF16_FLOPS = 989e12


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """--device and --dtype, held equal for both libraries (CPU float32 by default)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both run (default cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and math for both (default float32; bfloat16: TRL bf16=True on a bf16-loaded model)",
    )


def add_cpu_matmul_arg(p: argparse.ArgumentParser, where: str = "its CPU training products") -> None:
    """--cpu-matmul: rollout's `[backend] cpu_matmul` (the peer keeps torch's F.linear)."""
    p.add_argument("--cpu-matmul", choices=("torch", "onednn"), default="torch",
                   help=f"rollout's [backend] cpu_matmul: {where} through torch's F.linear or oneDNN "
                   "(default torch; benchmarks/cpu_linear.py)")


def trl_precision(args: argparse.Namespace) -> dict[str, bool]:
    """TRL/transformers TrainingArguments fields for `--device` / `--dtype`."""
    bf16 = args.dtype == "bfloat16"
    return {"bf16": bf16, "fp16": False, "use_cpu": args.device == "cpu"}


def torch_dtype(args: argparse.Namespace) -> torch.dtype:
    import torch

    return getattr(torch, args.dtype)


def mfu(tokens_per_s: float, n_params: int, device: str, flops_per_param: int = 6) -> str:
    """Model FLOPs utilisation of a training run, CUDA only: `flops_per_param` x N FLOPs per token (6: a
    forward and backward; DPO adds its reference's forward, 8), attention left out."""
    if device != "cuda":
        return ""
    return f", MFU {flops_per_param * n_params * tokens_per_s / PEAK_BF16_FLOPS:.1%} of 989 TFLOP/s"


class TokenCounter:
    """A forward pre-hook (`module.register_forward_pre_hook(counter.hook, with_kwargs=True)`) that
    counts the non-pad input tokens of every training forward, kept as tensors (no device sync a step);
    `total(start, end)` sums the counts of forwards start..end-1. A batch without an attention mask
    (padding-free, packed) counts every token."""

    def __init__(self) -> None:
        self.counts: list[object] = []

    def total(self, start: int, end: int) -> int:
        return sum(int(c) for c in self.counts[start:end])

    def hook(self, module: object, args: tuple, kwargs: dict) -> None:
        if not getattr(module, "training", False):
            return
        mask = kwargs.get("attention_mask")
        self.counts.append(mask.sum() if mask is not None else kwargs["input_ids"].numel())
