"""DPO training throughput: rollout vs TRL's `DPOTrainer`, same model, pairs and settings (CPU).

    .venv/bin/python benchmarks/dpo_throughput.py                   # default: ~2-3 minutes on 2 cores
    .venv/bin/python benchmarks/dpo_throughput.py --steps 60 --repeats 1      # quick look, under a minute
    .venv/bin/python benchmarks/dpo_throughput.py --omp-passive     # steadier on a machine others keep busy
    .venv/bin/python benchmarks/dpo_throughput.py --threads 1       # the steadiest on a shared machine
    .venv/bin/python benchmarks/dpo_throughput.py --precompute-ref  # reference log-probs precomputed, both
    python3 benchmarks/dpo_throughput.py --device cuda --dtype bfloat16 --model large   # a lent GPU

One run trains the tiny Qwen2 (`rollout model init-tiny`, ~1.05M params; or
`--model-dir`, e.g. an SFT export) on the arithmetic preference pairs (`rollout
data arithmetic`, `pref.jsonl`), once with `rollout.algorithms.dpo.train_dpo`
and once with `trl.DPOTrainer` per repeat, and prints optimizer steps per second
for each and the ratio rollout / TRL. Runs alternate which library goes first,
and medians over `--repeats` are reported.

Held equal (the header says it again):

- the same model folder, loaded in float32 with `attn_implementation="sdpa"`,
  and the same `pref.jsonl` pairs, rendered with the same ChatML template (the
  prompt with the generation prompt, then the answer and `<|im_end|>`);
- a frozen reference: a second copy of the same model on both sides, loaded
  separately and scored every step (rollout `reference.precompute = false`;
  TRL `ref_model=` a separately loaded copy, `precompute_ref_log_probs=False`).
  With `--precompute-ref` both compute the reference log-probs of every pair
  once before training instead (rollout `reference.precompute = true`, TRL
  `precompute_ref_log_probs=True`), outside the timed window;
- the loss: sigmoid DPO, beta 0.1 (TRL `loss_type=["sigmoid"]`, a list since
  TRL 1.0), mean over the pairs of the step, log-probs summed over the answer
  tokens; both project only the answer positions through the LM head (rollout
  `sequence_logps`, TRL `fused_lm_head=True`);
- `--batch-size` pairs per optimizer step (2x rows: chosen and rejected in one
  forward), no gradient accumulation, `--max-seq-len` tokens per sequence;
- float32 math on both: TRL gets `bf16=False, fp16=False` (its config defaults
  to bf16 where supported) and no activation checkpointing (on by default in
  DPOConfig);
- AdamW, lr 5e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0, constant
  schedule, no warmup, grad-norm clipping at 1.0, seed 0;
- `--steps` optimizer steps and `--threads` torch intra-op threads;
- nothing else inside the timed window: TRL `use_cpu=True`,
  `dataloader_num_workers=0`, `report_to=[]`, `logging_steps` past the end,
  `save_strategy="no"`, no progress bar; rollout without mid-run snapshots (its
  final snapshot is written after the last step) and without export. rollout
  still records its per-step metrics and events (that is part of its step).
  Both run torch's fused AdamW kernel (rollout: `fused=True`, `make_optimizer`; TRL: its
  default `optim="adamw_torch_fused"`).

Timed: training steps only. Model loading and tokenization come before, and the
first `--warmup-steps` steps are left out: steps/s = (N - warmup) / (end of step
N - end of step warmup). rollout: timestamps of its `train_step` events, read
back from its store. TRL: a `TrainerCallback` stamps `on_step_end`. Both count
the non-pad input tokens their policy trained on in the window (rollout's
`train/tokens_seen`, a forward pre-hook on TRL's policy), printed as a check that
they do the same work.

`--device cuda --dtype bfloat16 --model large` (a lent GPU, not CI): the same
comparison in bf16 on a ~190M random Qwen2 (TRL `bf16=True`, `use_cpu=False`, both
models loaded in bf16; rollout `dtype = "bfloat16"`, `device = "cuda"`), with the
model FLOPs utilisation (8 x params x policy tok/s: the policy's forward and backward,
6 N, and the reference's forward, 2 N, over 989 TFLOP/s bf16 dense). The TRL side
synchronises the device at the two ends of the timed window only.

Both runs must learn: the mean DPO loss of the last 20 steps is printed for each
(it starts at log 2 = 0.693, the policy being equal to the reference). The
libraries shuffle with their own samplers, so the values differ a little.

On a machine where other processes keep the cores busy, spinning OpenMP threads
stall each other; the header warns when the load average leaves fewer free
cores than `--threads`. Then use `--omp-passive` or `--threads 1`.
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
    torch_dtype,
    trl_precision,
)

LR = 5e-4
BETA = 0.1
SEED = 0
LOSS_WINDOW = 20  # final loss = mean of the last LOSS_WINDOW steps (one step is noisy)


@dataclass(frozen=True)
class Measurement:
    """One training run's timed window."""

    steps: int  # optimizer steps inside the window
    seconds: float
    tokens: int  # non-pad input tokens of the policy forwards inside the window
    final_loss: float  # mean DPO loss of the last LOSS_WINDOW steps

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    p.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the timed window (default 10)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step (default 16)")
    p.add_argument("--max-seq-len", type=int, default=64, help="max tokens per sequence (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both (default 2)")
    add_cpu_matmul_arg(p)
    p.add_argument("--repeats", type=int, default=3, help="runs per library; medians reported (default 3)")
    p.add_argument(
        "--precompute-ref",
        action="store_true",
        help="both: reference log-probs computed once before training instead of a frozen copy scored every "
        "step (rollout reference.precompute = true, TRL precompute_ref_log_probs=True)",
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="start from this model folder (e.g. local/models/sft-tiny) instead of a fresh random one",
    )
    p.add_argument(
        "--model", choices=tuple(MODEL_SIZES), default="tiny",
        help="random Qwen2 to train when no --model-dir: tiny ~1.05M (default), mid ~48M, large ~190M "
        "(for --device cuda)",
    )
    add_precision_args(p)
    p.add_argument(
        "--warmup-runs", type=int, default=None,
        help="untimed short runs of each library before the repeats (default: 1 on cuda, 0 on cpu): on a "
        "fresh GPU the process's first run trained at a third of the later runs' pace (2026-12-04)",
    )
    p.add_argument(
        "--omp-passive",
        action="store_true",
        help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning): "
        "steadier figures on a machine that other processes keep busy",
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_seq_len", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 1 or args.steps < max(args.warmup_steps + 5, LOSS_WINDOW):
        p.error(f"--steps must be >= {LOSS_WINDOW} and exceed --warmup-steps (>= 1) by at least 5")
    if args.warmup_runs is None:
        args.warmup_runs = 1 if args.device == "cuda" else 0
    if args.warmup_runs < 0:
        p.error("--warmup-runs must be >= 0")
    if args.model_dir is not None:
        if not (args.model_dir / "config.json").is_file():
            p.error(f"--model-dir {args.model_dir}: not a model folder (no config.json)")
        args.model_dir = args.model_dir.resolve()
    return args


# --------------------------------------------------------------------------- inputs


def prepare_inputs(work: Path, model_dir: Path | None, model: str = "tiny") -> tuple[Path, Path]:
    """The model folder (a fresh random `--model` unless given) and the arithmetic pref.jsonl."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    if model_dir is None:
        model_dir = init_tiny_model(work / "model", force=True, **MODEL_SIZES[model])
    data = write_arithmetic_dataset(work / "data")
    return model_dir, data["pref"]


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
kind = "dpo"
[algorithm.dpo]
minibatch_size = {batch_size}
gradient_accumulation = 1
max_grad_norm = 1.0
beta = {beta}
loss_type = "sigmoid"
label_smoothing = 0.0
[algorithm.dpo.base_model]
uri = "{model_dir}"
dtype = "{dtype}"
[algorithm.dpo.reference]
precompute = {precompute}
[algorithm.dpo.optimizer]
kind = "adamw"
lr = {lr}
[algorithm.dpo.scheduler]
kind = "constant"
warmup_steps = 0
[algorithm.dpo.budget]
max_steps = {steps}
[algorithm.dpo.dataset]
kind = "jsonl_path"
path = "{data_path}"
[algorithm.dpo.packing]
kind = "off"
max_seq_len = {max_seq_len}
[algorithm.dpo.snapshot]
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


def run_rollout(work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace) -> Measurement:
    from rollout.algorithms.dpo import train_dpo
    from rollout.config import load_config
    from rollout.store import open_store

    work.mkdir(parents=True)
    config_path = work / "dpo.toml"
    config_path.write_text(
        ROLLOUT_TOML.format(
            seed=SEED,
            work=work,
            model_dir=model_dir,
            dtype=args.dtype,
            device=args.device,
            data_path=data_path,
            batch_size=args.batch_size,
            beta=BETA,
            precompute="true" if args.precompute_ref else "false",
            lr=LR,
            steps=args.steps,
            max_seq_len=args.max_seq_len,
            threads=args.threads,
            cpu_matmul=args.cpu_matmul,
        )
    )
    result = train_dpo(load_config(config_path))
    store = open_store("embedded", path=work / "rollout.db")
    try:
        events = store.read_events(result.run_id)
        step_end = {e.fields["step"]: e.time for e in events if e.name == "train_step"}
        [start] = [e for e in events if e.name == "train_start"]
        seen = {m.step: m.value for m in store.read_metrics(result.run_id, name="train/tokens_seen")}
        losses = {m.step: m.value for m in store.read_metrics(result.run_id, name="train/loss")}
    finally:
        store.close()
    first, last = args.warmup_steps, result.steps
    assert last == args.steps, f"rollout stopped after {last} of {args.steps} steps"
    expected = "table" if args.precompute_ref else "copy"
    assert start.fields["reference"] == expected, f"rollout reference is {start.fields['reference']!r}"
    return Measurement(
        steps=last - first,
        seconds=step_end[last] - step_end[first],
        # tokens_seen counts chosen + rejected rows (the policy forward)
        tokens=int(seen[last] - seen[first]),
        final_loss=statistics.fmean(losses[s] for s in range(last - LOSS_WINDOW + 1, last + 1)),
    )


# --------------------------------------------------------------------------- TRL


def run_trl(work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace) -> Measurement:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    with data_path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    config = DPOConfig(
        output_dir=str(work),
        seed=SEED,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_length=args.max_seq_len,
        beta=BETA,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=args.precompute_ref,
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
        logging_steps=10 * args.steps,  # no logging inside the window
        save_strategy="no",
        disable_tqdm=True,
        **no_activation_checkpointing(DPOConfig),
    )
    load = {"dtype": torch_dtype(args), "attn_implementation": "sdpa"}
    policy = AutoModelForCausalLM.from_pretrained(model_dir, **load)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, **load)  # a separate, frozen copy
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    ref_forwards = [
        0
    ]  # calls of the frozen copy's forward: every step, or only before training if precomputed
    trainer.ref_model.register_forward_pre_hook(lambda *_: ref_forwards.__setitem__(0, ref_forwards[0] + 1))
    trainer.remove_callback(PrinterCallback)  # the end-of-train summary dict
    model = trainer.model
    assert trainer.ref_model is not None and trainer.ref_model is not model, "TRL has no separate reference"
    assert model.dtype == torch_dtype(args) and model.config._attn_implementation == "sdpa", (
        f"TRL model is not {args.dtype}/sdpa"
    )
    checkpointing = "is_activation_checkpointing"  # transformers 5 name; is_gradient_checkpointing before
    if not hasattr(type(model), checkpointing):
        checkpointing = "is_gradient_checkpointing"
    assert not getattr(model, checkpointing), "TRL turned on activation checkpointing"

    counter = TokenCounter()
    model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    losses: list[torch.Tensor] = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*a: object, **kw: object) -> torch.Tensor:
        loss = compute_loss(*a, **kw)
        losses.append(loss.detach())  # no .item(): keep the step free of extra syncs
        return loss

    trainer.compute_loss = recording_compute_loss  # type: ignore[method-assign]
    marks: dict[int, tuple[float, int, int]] = {}
    cuda = args.device == "cuda"

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if cuda and state.global_step in (args.warmup_steps, args.steps):
                torch.cuda.synchronize()  # the window's two ends only: no extra sync inside it
            marks[state.global_step] = (time.time(), len(counter.counts), ref_forwards[0])

    trainer.add_callback(StepClock())
    torch.set_num_threads(args.threads)
    trainer.train()
    first, last = args.warmup_steps, args.steps
    assert max(marks) == last and len(losses) == last, f"TRL ran {max(marks)} steps, {len(losses)} losses"
    ref_calls = marks[last][2] - marks[first][2]
    assert ref_calls == (0 if args.precompute_ref else last - first), (
        f"TRL scored the reference {ref_calls} times"
    )
    return Measurement(
        steps=last - first,
        seconds=marks[last][0] - marks[first][0],
        tokens=counter.total(marks[first][1], marks[last][1]),
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
    model = args.model_dir or f"random {args.model} Qwen2 {args.n_params / 1e6:.2f}M params"
    reference = (
        "log-probs precomputed before training" if args.precompute_ref else "frozen copy scored every step"
    )
    print(f"DPO throughput: rollout vs TRL DPOTrainer ({model}, arithmetic pref pairs, {args.device})")
    print(
        f"  versions: rollout {rollout.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"  steps {args.steps} (timed: {args.warmup_steps + 1}..{args.steps}), batch {args.batch_size} pairs "
        f"({2 * args.batch_size} rows), max seq len {args.max_seq_len}, threads {args.threads}, "
        f"repeats {args.repeats}; cpus {os.cpu_count()}, load avg {load}, "
        f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        f"  both: sigmoid DPO beta {BETA}, reference {reference}, {args.dtype}, sdpa, "
        f"no grad checkpointing, AdamW lr {LR:g} constant, no warmup, clip 1.0, seed 0, no grad accumulation, "
        "no logging/saving inside the timed window"
    )
    print("  steps/s = timed optimizer steps / wall seconds; median over repeats")
    load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if (
        args.threads > 1
        and cpus - load1 < args.threads - 0.5
        and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE"
    ):
        print(
            f"  WARNING: load average {load1:.1f} on {cpus} cpus leaves ~{max(cpus - load1, 0):.1f} free for "
            f"{args.threads} threads: spinning OpenMP threads that share a core stall each other and the "
            "figures swing; re-run on an idle machine, or add --omp-passive, or use --threads 1."
        )
    elif load1 > cpus - 0.5:
        print(f"  note: load average {load1:.1f} on {cpus} cpus: slower and noisier than on an idle machine")
    print(flush=True)


def print_table(results: dict[str, list[Measurement]]) -> None:
    ours, theirs = results["rollout"], results["trl"]
    ours_sps = statistics.median(m.steps_per_s for m in ours)
    theirs_sps = statistics.median(m.steps_per_s for m in theirs)
    per_repeat = " ".join(f"{a.steps_per_s / b.steps_per_s:.2f}" for a, b in zip(ours, theirs, strict=True))
    print()
    print(
        f"{'rollout steps/s':>15} | {'TRL steps/s':>11} | {'ratio':>5} | {'ratios per repeat':<20} | "
        f"{'ms/step rollout / TRL':>21} | {'tokens/step rollout / TRL':>25} | final loss rollout / TRL"
    )
    print("-" * 140)
    tokens = (
        f"{statistics.median(m.tokens / m.steps for m in ours):,.0f} / "
        f"{statistics.median(m.tokens / m.steps for m in theirs):,.0f}"
    )
    ms = f"{1000 / ours_sps:.1f} / {1000 / theirs_sps:.1f}"
    loss = (
        f"{statistics.median(m.final_loss for m in ours):.3f} / "
        f"{statistics.median(m.final_loss for m in theirs):.3f}"
    )
    print(
        f"{ours_sps:>15.2f} | {theirs_sps:>11.2f} | {ours_sps / theirs_sps:>4.2f}x | {per_repeat:<20} | "
        f"{ms:>21} | {tokens:>25} | {loss}"
    )
    print(f"\nload avg at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


# --------------------------------------------------------------------------- main




def _mfu(m: Measurement, args: argparse.Namespace) -> str:
    """8 N FLOPs per policy token (policy forward + backward 6 N, the reference's forward 2 N)."""
    return "" if args.precompute_ref else mfu(m.tokens / m.seconds, args.n_params, args.device, flops_per_param=8)


def main(argv: list[str] | None = None) -> int:
    from rollout.models.tiny import count_saved_parameters

    args = parse_args(argv)
    prepare_trl_process(omp_passive=args.omp_passive)
    runners = {"rollout": run_rollout, "trl": run_trl}
    results: dict[str, list[Measurement]] = {lib: [] for lib in runners}
    with tempfile.TemporaryDirectory(prefix="dpo-throughput-") as tmp:
        work = Path(tmp)
        model_dir, data_path = prepare_inputs(work, args.model_dir, args.model)
        args.n_params = count_saved_parameters(model_dir)
        print_header(args)
        short = argparse.Namespace(**{**vars(args), "steps": max(args.warmup_steps + 5, LOSS_WINDOW)})
        for i in range(args.warmup_runs):  # untimed: the process's first runs pay for what later ones reuse
            for lib, runner in runners.items():
                with quiet_stderr():
                    runner(work / f"warmup-{lib}-{i}", model_dir, data_path, short)
            print(f"warm-up run {i + 1}/{args.warmup_runs} of each library done (untimed)", flush=True)
        for repeat in range(args.repeats):
            # alternate who goes first, so a load change drifts onto both sides
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for lib in order:
                with quiet_stderr():  # progress lines of both libraries
                    m = runners[lib](work / f"{lib}-{repeat}", model_dir, data_path, args)
                results[lib].append(m)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {lib:<7} {m.steps_per_s:>6.2f} steps/s "
                    f"({m.steps} steps in {m.seconds:.2f}s, {m.tokens / m.steps:,.0f} tokens/step), "
                    f"final loss {m.final_loss:.3f}, load {os.getloadavg()[0]:.1f}{_mfu(m, args)}",
                    flush=True,
                )
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
