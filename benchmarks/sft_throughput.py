"""SFT training throughput: rollout vs TRL's `SFTTrainer`, same model, data and settings (CPU).

    .venv/bin/python benchmarks/sft_throughput.py                 # default: ~3 minutes on 2 cores
    .venv/bin/python benchmarks/sft_throughput.py --steps 60 --repeats 1    # quick look, ~1 minute
    .venv/bin/python benchmarks/sft_throughput.py --omp-passive   # steadier on a machine others keep busy
    .venv/bin/python benchmarks/sft_throughput.py --data mixed    # lengths 17-245 tokens: what packing is for
    make bench                                                    # installs the [bench] extra, runs the default

One run trains the tiny Qwen2 (`rollout model init-tiny`, ~1.05M params) on the
arithmetic SFT lines (`rollout data arithmetic`, 17-19 tokens each), once with
`rollout.algorithms.sft.train_sft` and once with `trl.SFTTrainer` per mode and
repeat, and prints non-pad input tokens per second for each and the ratio
rollout / TRL: first without packing (padded rows), then with best-fit-decreasing
packing. Runs alternate which library goes first, and medians over `--repeats`
are reported.

Held equal (the header says it again):

- the same model folder, loaded in float32 with `attn_implementation="sdpa"`, and
  the same `sft.jsonl` rows, rendered with the same ChatML template;
- float32 math on both: TRL gets `bf16=False, fp16=False` (its SFTConfig defaults
  to bf16 where supported) and `activation_checkpointing=False` (alias
  `gradient_checkpointing`, on by default in SFTConfig);
- the loss: cross-entropy on the assistant tokens (`loss_on = "assistant"` vs
  `assistant_only_loss=True`) or, with `--loss-on full`, on every token; both
  project only the target positions through the LM head;
- `--batch-size` rows per optimizer step, no gradient accumulation,
  `--max-seq-len` tokens per sample / packed row (TRL `max_length`);
- AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0, constant
  schedule, no warmup, grad-norm clipping at 1.0, seed 0;
- `--steps` optimizer steps and `--threads` torch intra-op threads;
- nothing else inside the timed window: TRL `use_cpu=True`,
  `dataloader_num_workers=0`, `report_to=[]`, `logging_strategy="no"`,
  `save_strategy="no"`, no progress bar; rollout without mid-run snapshots (its
  final snapshot is written after the last step) and without export. rollout
  still records its per-step metrics and events (that is part of its step).
  Both run torch's fused AdamW kernel (rollout: `fused=True`, `make_optimizer`; TRL: its
  default `optim="adamw_torch_fused"`).

Timed: training steps only. Model loading, tokenization and packing come before,
and the first `--warmup-steps` steps are left out: tok/s = non-pad input tokens
of steps warmup+1..N / (end of step N - end of step warmup). rollout: timestamps
of its `train_step` events and its `train/tokens_seen` metric, read back from its
store. TRL: a `TrainerCallback` stamps `on_step_end`, and a forward pre-hook on
the model counts each batch's non-pad tokens (`attention_mask.sum()` when
padded, every token of the flattened padding-free row when packed). Both count
input tokens (prompt + answer), not loss tokens.

Packing. rollout `[algorithm.sft.packing] kind = "bfd"`: whole samples packed
into rows of at most `--max-seq-len` tokens; a micro-batch is `--batch-size` rows
right-padded to the longest, with a block-diagonal causal mask and position ids
that restart per sample. TRL `packing=True, packing_strategy="bfd"`: the same
packing, then padding-free collation: the batch's rows are concatenated into ONE
row with restarting position_ids, from which transformers rebuilds a
block-diagonal mask. Both train on the same tokens per step; on CPU (sdpa, no
flash-attention varlen kernel) TRL's attention runs over one ~batch*seq-long row,
so its cost grows with the square of the whole batch's tokens.

`--data mixed`: the arithmetic lines and the guess-the-number SFT traces
(`rollout data guess-number`: multi-turn games of 157-245 tokens, loss on every
assistant turn), shuffled together (seed 0), rows of at most 256 tokens. The
arithmetic lines alone are 17-19 tokens, so padding them wastes almost nothing
and packing can only win by its larger rows; mixed lengths are what SFT data
usually looks like, and where padded batches spend most of their compute on pad.

`--device cuda --dtype bfloat16 --model large` (a lent GPU, not CI): the same
comparison in bf16 on a ~190M random Qwen2 (TRL `bf16=True`, `use_cpu=False`, its
model loaded in bf16; rollout `dtype = "bfloat16"`, `device = "cuda"`), with the
model FLOPs utilisation (6 x params x tok/s over 989 TFLOP/s bf16 dense). The TRL
side synchronises the device at the two ends of the timed window only.

Both runs must learn: the mean training loss of the last 20 steps is printed for
each. The libraries shuffle with their own samplers, so the values differ by a few
hundredths (padded) to about a tenth (packed, few loss tokens per step).

On a machine where other processes keep the cores busy, OpenMP threads that
spin-wait for a core stall each other and 2-thread figures can drop tenfold
and swing from run to run; the header warns when the load average leaves fewer
free cores than `--threads`. Then use `--omp-passive` (OMP_WAIT_POLICY=PASSIVE,
for both libraries) or `--threads 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_common import (
    MODEL_SIZES,
    TokenCounter,
    add_cpu_matmul_arg,
    add_precision_args,
    mfu,
    no_activation_checkpointing,
    prepare_trl_process,
    quiet_stderr,
    rollout_window,
    torch_dtype,
    trl_precision,
)

LR = 1e-3
SEED = 0
LOSS_WINDOW = 20  # final loss = mean of the last LOSS_WINDOW steps (one step is noisy)
MODES = ("padded", "packed")
DATA = ("arithmetic", "mixed")
MAX_SEQ_LEN = {"arithmetic": 64, "mixed": 256}


@dataclass(frozen=True)
class Measurement:
    """One training run's timed window."""

    tokens: int  # non-pad input tokens trained on inside the window
    seconds: float
    final_loss: float  # mean training loss of the last LOSS_WINDOW steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    p.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the timed window (default 10)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step (default 16)")
    p.add_argument(
        "--max-seq-len", type=int, default=None,
        help="max tokens per sample / packed row (default 64; 256 with --data mixed)",
    )
    p.add_argument("--data", choices=DATA, default="arithmetic",
                   help="arithmetic lines (17-19 tokens) or mixed with guess-number games (up to 245)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both (default 2)")
    add_cpu_matmul_arg(p)
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per library and mode; medians reported (default 3)"
    )
    p.add_argument(
        "--loss-on",
        choices=("assistant", "full"),
        default="assistant",
        help="loss tokens (default assistant)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of padded,packed")
    p.add_argument(
        "--model", choices=tuple(MODEL_SIZES), default="tiny",
        help="random Qwen2 to train: tiny ~1.05M (default), mid ~48M, large ~190M (for --device cuda)",
    )
    add_precision_args(p)
    p.add_argument(
        "--omp-passive",
        action="store_true",
        help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning): "
        "steadier figures on a machine that other processes keep busy",
    )
    args = p.parse_args(argv)
    if args.max_seq_len is None:
        args.max_seq_len = MAX_SEQ_LEN[args.data]
    for name in ("steps", "batch_size", "max_seq_len", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 1 or args.steps < max(args.warmup_steps + 5, LOSS_WINDOW):
        p.error(f"--steps must be >= {LOSS_WINDOW} and exceed --warmup-steps (>= 1) by at least 5")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    return args


# --------------------------------------------------------------------------- inputs


def prepare_inputs(work: Path, data: str = "arithmetic", model: str = "tiny") -> tuple[Path, Path]:
    """The model folder (`--model`) and the SFT jsonl (`--data`), made fresh under `work`."""
    import random

    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset
    from rollout.tasks.guess_number import write_guess_number_data

    model_dir = init_tiny_model(work / "model", force=True, **MODEL_SIZES[model])
    arithmetic = write_arithmetic_dataset(work / "data")["sft"]
    if data == "arithmetic":
        return model_dir, arithmetic
    games = write_guess_number_data(work / "guess")["sft"]
    lines = [line for path in (arithmetic, games) for line in path.read_text().splitlines() if line.strip()]
    random.Random(0).shuffle(lines)
    mixed = work / "mixed.jsonl"
    mixed.write_text("\n".join(lines) + "\n")
    return model_dir, mixed


# --------------------------------------------------------------------------- rollout

ROLLOUT_TOML = """\
schema_version = 1
seed = {seed}

[storage]
backend = "embedded"
[storage.embedded]
path = "{work}/rollout.db"
[storage.objects]
backend = "fs"
path = "{work}/object-store"

[algorithm]
kind = "sft"
[algorithm.sft]
minibatch_size = {batch_size}
gradient_accumulation = 1
max_grad_norm = 1.0
[algorithm.sft.base_model]
uri = "{model_dir}"
dtype = "{dtype}"
[algorithm.sft.optimizer]
kind = "adamw"
lr = {lr}
[algorithm.sft.scheduler]
kind = "constant"
warmup_steps = 0
[algorithm.sft.budget]
max_steps = {steps}
[algorithm.sft.dataset]
kind = "jsonl_path"
path = "{data_path}"
[algorithm.sft.packing]
kind = "{packing}"
max_seq_len = {max_seq_len}
[algorithm.sft.loss_on]
kind = "{loss_on}"
[algorithm.sft.snapshot]
every_steps = 1000000
keep_last = 1

[backend]
kind = "torch"
device = "{device}"
num_threads = {threads}
cpu_matmul = "{cpu_matmul}"

[distributed]
kind = "local"
"""


def run_rollout(
    work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace, *, packed: bool
) -> Measurement:
    from rollout.algorithms.sft import train_sft
    from rollout.config import load_config

    work.mkdir(parents=True)
    config_path = work / "sft.toml"
    config_path.write_text(
        ROLLOUT_TOML.format(
            seed=SEED,
            work=work,
            model_dir=model_dir,
            data_path=data_path,
            batch_size=args.batch_size,
            lr=LR,
            steps=args.steps,
            packing="bfd" if packed else "off",
            max_seq_len=args.max_seq_len,
            loss_on=args.loss_on,
            threads=args.threads,
            cpu_matmul=args.cpu_matmul,
            dtype=args.dtype,
            device=args.device,
        )
    )
    result = train_sft(load_config(config_path))
    w = rollout_window(work / "rollout.db", result.run_id, warmup_steps=args.warmup_steps, steps=args.steps,
                       loss_window=LOSS_WINDOW)
    return Measurement(tokens=w.tokens, seconds=w.seconds, final_loss=w.final_loss)


# --------------------------------------------------------------------------- TRL


def run_trl(
    work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace, *, packed: bool
) -> Measurement:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    with data_path.open(encoding="utf-8") as f:
        dataset = Dataset.from_list(
            [{"messages": json.loads(line)["messages"]} for line in f if line.strip()]
        )
    config = SFTConfig(
        output_dir=str(work),
        seed=SEED,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_length=args.max_seq_len,
        packing=packed,
        packing_strategy="bfd",
        assistant_only_loss=args.loss_on == "assistant",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        **trl_precision(args),
        dataloader_num_workers=0,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch_dtype(args), "attn_implementation": "sdpa"},
        **no_activation_checkpointing(SFTConfig),
    )
    trainer = SFTTrainer(model=str(model_dir), args=config, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # the end-of-train summary dict
    model = trainer.model
    assert model.dtype == torch_dtype(args) and model.config._attn_implementation == "sdpa", (
        f"TRL model is not {args.dtype}/sdpa"
    )
    checkpointing = "is_activation_checkpointing"  # transformers 5 name; is_gradient_checkpointing before
    if not hasattr(type(model), checkpointing):
        checkpointing = "is_gradient_checkpointing"
    assert not getattr(model, checkpointing), "TRL turned on activation checkpointing"
    # the token counter below takes every token of a padding-free row as real
    assert getattr(trainer.data_collator, "pad_to_multiple_of", None) is None, "TRL pads to a multiple"

    counter = TokenCounter()
    trainer.model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    losses: list[torch.Tensor] = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*a: object, **kw: object) -> torch.Tensor:
        loss = compute_loss(*a, **kw)
        losses.append(loss.detach())  # no .item(): keep the step free of extra syncs
        return loss

    trainer.compute_loss = recording_compute_loss  # type: ignore[method-assign]
    marks: dict[int, tuple[float, int]] = {}
    cuda = args.device == "cuda"

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if cuda and state.global_step in (args.warmup_steps, args.steps):
                torch.cuda.synchronize()  # the window's two ends only: no extra sync inside it
            marks[state.global_step] = (time.time(), len(counter.counts))

    trainer.add_callback(StepClock())
    torch.set_num_threads(args.threads)
    trainer.train()
    first, last = args.warmup_steps, args.steps
    assert max(marks) == last and len(losses) == last, f"TRL ran {max(marks)} steps, {len(losses)} losses"
    return Measurement(
        tokens=counter.total(marks[first][1], marks[last][1]),
        seconds=marks[last][0] - marks[first][0],
        final_loss=float(torch.stack(losses[-LOSS_WINDOW:]).float().mean()),
    )


# --------------------------------------------------------------------------- report


def print_header(args: argparse.Namespace) -> None:
    import platform

    import torch
    import transformers
    import trl

    import rollout

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    data = "arithmetic SFT" if args.data == "arithmetic" else "arithmetic + guess-number SFT, mixed lengths"
    where = "CPU" if args.device == "cpu" else f"CUDA {torch.cuda.get_device_name()}"
    print(
        f"SFT throughput: rollout vs TRL SFTTrainer ({args.model} Qwen2 {args.n_params / 1e6:.2f}M params, "
        f"{data}, {where})"
    )
    print(
        f"  versions: rollout {rollout.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"  steps {args.steps} (timed: {args.warmup_steps + 1}..{args.steps}), batch {args.batch_size} rows, "
        f"max seq len {args.max_seq_len}, threads {args.threads}, repeats {args.repeats}, "
        f"loss on {args.loss_on}; cpus {os.cpu_count()}, load avg {load}, "
        f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        f"  both: {args.dtype}, sdpa, no grad checkpointing, AdamW lr 1e-3 constant, no warmup, clip 1.0, seed 0, "
        "no grad accumulation, no logging/saving inside the timed window"
    )
    print("  tok/s = non-pad input tokens / wall seconds over the timed steps; median over repeats")
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if (
        args.threads > 1
        and cpus - load < args.threads - 0.5
        and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE"
    ):
        print(
            f"  WARNING: load average {load:.1f} on {cpus} cpus leaves ~{max(cpus - load, 0):.1f} free for "
            f"{args.threads} threads: spinning OpenMP threads that share a core stall each other and the "
            "figures swing tenfold; re-run on an idle machine, or add --omp-passive, or use --threads 1."
        )
    elif load > cpus - 0.5:
        print(f"  note: load average {load:.1f} on {cpus} cpus: slower and noisier than on an idle machine")
    print(
        "  packed: rollout bfd = batch rows of <=max-seq-len tokens, padded to the longest, block-diagonal mask; "
        "TRL bfd = same packing, batch flattened into one padding-free row (position_ids resets)\n",
        flush=True,
    )


def print_table(results: dict[tuple[str, str], list[Measurement]], args: argparse.Namespace) -> None:
    """ratio = median rollout tok/s / median TRL tok/s; pairs = median of the per-repeat ratios
    (each pair runs back to back, so a load change between repeats cancels out better)."""
    print()
    print(
        f"{'mode':<7} | {'rollout tok/s':>13} | {'TRL tok/s':>9} | {'ratio':>5} | {'pairs':>5} | "
        f"{'ratio per repeat':<18} | loss rollout / TRL"
    )
    print("-" * 96)
    for mode in args.modes:
        ours, theirs = results[("rollout", mode)], results[("trl", mode)]
        ours_tps = statistics.median(m.tokens_per_s for m in ours)
        theirs_tps = statistics.median(m.tokens_per_s for m in theirs)
        pairs = [a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs, strict=True)]
        per_repeat = " ".join(f"{r:.2f}" for r in pairs)
        ours_loss = statistics.median(m.final_loss for m in ours)
        theirs_loss = statistics.median(m.final_loss for m in theirs)
        print(
            f"{mode:<7} | {ours_tps:>13,.0f} | {theirs_tps:>9,.0f} | {ours_tps / theirs_tps:>4.2f}x | "
            f"{statistics.median(pairs):>4.2f}x | {per_repeat:<18} | {ours_loss:.3f} / {theirs_loss:.3f}"
        )
    if args.device == "cuda":
        for mode in args.modes:
            for lib in ("rollout", "trl"):
                tps = statistics.median(m.tokens_per_s for m in results[(lib, mode)])
                print(f"{mode} {lib}: {tps:,.0f} tok/s{mfu(tps, args.n_params, args.device)} (6 N per token)")
    print(
        "ratio: of the medians; pairs: median of the per-repeat ratios; "
        f"loss: mean training loss of the last {LOSS_WINDOW} steps"
    )
    print(f"load avg at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


# --------------------------------------------------------------------------- main




def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_trl_process(omp_passive=args.omp_passive)
    from rollout.models.tiny import count_saved_parameters

    runners = {"rollout": run_rollout, "trl": run_trl}
    results: dict[tuple[str, str], list[Measurement]] = {(lib, m): [] for lib in runners for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="sft-throughput-") as tmp:
        work = Path(tmp)
        model_dir, data_path = prepare_inputs(work, args.data, args.model)
        args.n_params = count_saved_parameters(model_dir)
        print_header(args)
        for repeat in range(args.repeats):
            # alternate who goes first, so a load change drifts onto both sides
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for mode in args.modes:
                for lib in order:
                    with quiet_stderr():  # progress lines of both libraries
                        m = runners[lib](
                            work / f"{lib}-{mode}-{repeat}",
                            model_dir,
                            data_path,
                            args,
                            packed=mode == "packed",
                        )
                    results[(lib, mode)].append(m)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {mode:<6} {lib:<7} {m.tokens_per_s:>9,.0f} tok/s "
                        f"({m.tokens:,} tokens in {m.seconds:.2f}s{mfu(m.tokens_per_s, args.n_params, args.device)}), "
                        f"final loss {m.final_loss:.3f}, "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
