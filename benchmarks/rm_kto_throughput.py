"""Reward-model and KTO training throughput: rollout vs TRL's `RewardTrainer` / `KTOTrainer` (CPU).

    .venv/bin/python benchmarks/rm_kto_throughput.py --algo rm               # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/rm_kto_throughput.py --algo kto --threads 1  # the steadiest on a shared machine
    .venv/bin/python benchmarks/rm_kto_throughput.py --algo rm --steps 60 --repeats 1   # a quick look
    make bench                                                               # runs both as jobs `rm` and `kto`

Like `dpo_throughput.py` (its conventions, held equal the same way), for the other two trainers
that learn from labelled answers. One run trains the tiny Qwen2 (`rollout model init-tiny`,
~1.05M params) on the arithmetic data (`rollout data arithmetic`), once with rollout and once
with TRL per repeat, and prints optimizer steps per second for each and the ratio rollout / TRL.
Runs alternate which library goes first; medians over `--repeats` are reported.

`--algo rm`: Bradley-Terry reward model on `pref.jsonl` (prompt, chosen, rejected). Both load the
model folder as `AutoModelForSequenceClassification` with one label (a new score head, seed 0),
score prompt+chosen and prompt+rejected at their last real token in one forward (2x rows), loss
-log sigmoid(r_chosen - r_rejected), mean over the pairs; no margin, no reward centring (rollout
`center_rewards_coefficient` unset, TRL `None`). rollout scores each prompt's tokens once for
both answers (`prefix.collate_shared_pairs`), TRL runs both full rows.

`--algo kto`: KTO (Ethayarajh et al., 2024) on `kto.jsonl` (prompt, completion, label), beta 0.1,
desirable and undesirable weights 1, a frozen reference (a second, separately loaded copy scored
every step: rollout `reference.precompute = false`, TRL `ref_model=`,
`precompute_ref_log_probs=False`), and the KL reference point z0 estimated from mismatched
prompt/completion pairs of the batch under no gradient, on both (TRL `loss_type="kto"`).

Both sides: float32 (TRL `bf16=False`), sdpa attention, no activation checkpointing, AdamW lr
5e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0, constant schedule, no warm-up, clipping at
1.0, seed 0, `--batch-size` pairs (rm) or lines (kto) per optimizer step, no gradient
accumulation, sequences cut at `--max-seq-len` tokens, `--threads` torch threads; nothing else in
the timed window (TRL: no logging, saving, progress bar or dataloader workers; rollout: no
mid-run snapshots or export, but its per-step metrics and events, which are part of its step).

Timed: steps `--warmup-steps`+1 .. `--steps` (after loading and tokenization), from rollout's
`train_step` events and a TRL `on_step_end` callback. Tokens per step (non-pad input tokens of
the trained model's forwards, rollout's `train/tokens_seen`, a pre-hook on TRL's model) are
printed as a check that both do the same work; both must learn (mean loss of the last 20 steps;
they start near log 2 = 0.693 and shuffle with their own samplers).
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
from typing import Any

from bench_common import no_activation_checkpointing, prepare_trl_process, quiet_stderr, rollout_window

LR = 5e-4
BETA = 0.1
SEED = 0
LOSS_WINDOW = 20
ALGOS = ("rm", "kto")


@dataclass(frozen=True)
class Measurement:
    """One training run's timed window."""

    steps: int
    seconds: float
    tokens: int  # non-pad input tokens of the trained model's forwards inside the window
    final_loss: float  # mean loss of the last LOSS_WINDOW steps

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algo", choices=ALGOS, default="rm", help="rm (RewardTrainer) or kto (KTOTrainer)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the timed window (default 10)")
    p.add_argument("--batch-size", type=int, default=16, help="pairs (rm) or lines (kto) per step (default 16)")
    p.add_argument("--max-seq-len", type=int, default=64, help="max tokens per sequence (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="runs per library; medians reported (default 3)")
    p.add_argument("--omp-passive", action="store_true",
                   help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_seq_len", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.algo == "kto" and args.batch_size < 2:
        p.error("--batch-size must be >= 2 for kto (the KL estimate pairs mismatched lines)")
    if args.warmup_steps < 1 or args.steps < max(args.warmup_steps + 5, LOSS_WINDOW):
        p.error(f"--steps must be >= {LOSS_WINDOW} and exceed --warmup-steps (>= 1) by at least 5")
    return args


def prepare_inputs(work: Path, algo: str) -> tuple[Path, Path]:
    """A fresh tiny model folder and the arithmetic lines the algorithm trains on."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    model_dir = init_tiny_model(work / "model", force=True)
    data = write_arithmetic_dataset(work / "data")
    return model_dir, data["pref" if algo == "rm" else "kto"]


# --------------------------------------------------------------------------- rollout

def rollout_config(work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run config (what a TOML file would hold): the settings the module docstring lists."""
    algo: dict[str, Any] = {
        "minibatch_size": args.batch_size, "gradient_accumulation": 1, "max_grad_norm": 1.0,
        "base_model": {"uri": str(model_dir), "dtype": "float32"},
        "optimizer": {"kind": "adamw", "lr": LR}, "scheduler": {"kind": "constant", "warmup_steps": 0},
        "budget": {"max_steps": args.steps}, "dataset": {"kind": "jsonl_path", "path": str(data_path)},
        "packing": {"kind": "off", "max_seq_len": args.max_seq_len},
        "snapshot": {"every_steps": 1_000_000, "keep_last": 1},
    }
    if args.algo == "rm":
        algo["head"] = "bradley_terry"
    else:
        algo |= {"beta": BETA, "desirable_weight": 1.0, "undesirable_weight": 1.0,
                 "reference": {"precompute": False}}
    return {
        "schema_version": 1, "seed": SEED,
        "storage": {"backend": "embedded", "embedded": {"path": str(work / "rollout.db")},
                    "objects": {"backend": "fs", "path": str(work / "object-store")}},
        "algorithm": {"kind": args.algo, args.algo: algo},
        "backend": {"kind": "torch", "device": "cpu", "num_threads": args.threads},
        "distributed": {"kind": "local"},
    }


def run_rollout(work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace) -> Measurement:
    from rollout.algorithms.kto import train_kto
    from rollout.algorithms.rm import train_rm
    from rollout.config import RunConfig

    work.mkdir(parents=True)
    cfg = RunConfig.model_validate(rollout_config(work, model_dir, data_path, args), context={"base_dir": work})
    result = (train_rm if args.algo == "rm" else train_kto)(cfg)
    w = rollout_window(work / "rollout.db", result.run_id, warmup_steps=args.warmup_steps, steps=args.steps,
                       loss_window=LOSS_WINDOW)
    return Measurement(steps=w.steps, seconds=w.seconds, tokens=w.tokens, final_loss=w.final_loss)


# --------------------------------------------------------------------------- TRL


def run_trl(work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace) -> Measurement:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )

    with data_path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    common = dict(
        output_dir=str(work), seed=SEED, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, max_length=args.max_seq_len, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0,
        report_to=[], logging_steps=10 * args.steps, save_strategy="no", disable_tqdm=True,
    )
    load = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref_forwards = [0]
    if args.algo == "rm":
        from trl import RewardConfig, RewardTrainer

        dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
        config = RewardConfig(**common, center_rewards_coefficient=None, **no_activation_checkpointing(RewardConfig))
        torch.manual_seed(SEED)  # the new score head
        policy = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id, **load)
        trainer = RewardTrainer(model=policy, args=config, train_dataset=dataset, processing_class=tokenizer)
    else:
        from trl import KTOConfig, KTOTrainer

        dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "completion", "label")} for r in rows])
        config = KTOConfig(**common, beta=BETA, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto",
                           precompute_ref_log_probs=False, **no_activation_checkpointing(KTOConfig))
        policy = AutoModelForCausalLM.from_pretrained(model_dir, **load)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, **load)  # a separate, frozen copy
        trainer = KTOTrainer(model=policy, ref_model=reference, args=config, train_dataset=dataset,
                             processing_class=tokenizer)
        assert trainer.ref_model is not None and trainer.ref_model is not trainer.model, "TRL has no reference"
        trainer.ref_model.register_forward_pre_hook(lambda *_: ref_forwards.__setitem__(0, ref_forwards[0] + 1))
    trainer.remove_callback(PrinterCallback)
    model = trainer.model
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa", "TRL model is not fp32/sdpa"
    checkpointing = "is_activation_checkpointing"  # transformers 5 name; is_gradient_checkpointing before
    if not hasattr(type(model), checkpointing):
        checkpointing = "is_gradient_checkpointing"
    assert not getattr(model, checkpointing), "TRL turned on activation checkpointing"

    tokens = [0]

    def count(module: object, a: tuple, kw: dict) -> None:
        if getattr(module, "training", False) and torch.is_grad_enabled():  # KTO's KL pass runs under no_grad
            mask = kw.get("attention_mask")
            tokens[0] += int(mask.sum()) if mask is not None else kw["input_ids"].numel()

    model.register_forward_pre_hook(count, with_kwargs=True)
    losses: list[torch.Tensor] = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*a: object, **kw: object) -> torch.Tensor:
        out = compute_loss(*a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        losses.append(loss.detach())
        return out

    trainer.compute_loss = recording_compute_loss  # type: ignore[method-assign]
    marks: dict[int, tuple[float, int, int]] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            marks[state.global_step] = (time.time(), tokens[0], ref_forwards[0])

    trainer.add_callback(StepClock())
    torch.set_num_threads(args.threads)
    trainer.train()
    first, last = args.warmup_steps, args.steps
    assert max(marks) == last and len(losses) == last, f"TRL ran {max(marks)} steps, {len(losses)} losses"
    if args.algo == "kto":
        ref_calls = marks[last][2] - marks[first][2]
        assert ref_calls >= last - first, f"TRL scored the reference {ref_calls} times in {last - first} steps"
    return Measurement(
        steps=last - first,
        seconds=marks[last][0] - marks[first][0],
        tokens=marks[last][1] - marks[first][1],
        final_loss=float(torch.stack(losses[-LOSS_WINDOW:]).mean()),
    )


# --------------------------------------------------------------------------- report


def print_header(args: argparse.Namespace) -> None:
    import platform

    import torch
    import transformers
    import trl

    import rollout

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    peer = "RewardTrainer" if args.algo == "rm" else "KTOTrainer"
    print(f"{args.algo.upper()} throughput: rollout vs TRL {peer} (tiny Qwen2 ~1.05M params, arithmetic, CPU)")
    print(f"  versions: rollout {rollout.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"  steps {args.steps} (timed: {args.warmup_steps + 1}..{args.steps}), batch {args.batch_size}, "
          f"max seq len {args.max_seq_len}, threads {args.threads}, repeats {args.repeats}; cpus {os.cpu_count()}, "
          f"load avg {load}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"  both: float32, sdpa, no grad checkpointing, AdamW lr {LR:g} constant, clip 1.0, seed 0"
          + ("" if args.algo == "rm" else f"; KTO beta {BETA}, frozen reference scored every step, KL from mismatched pairs"))
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_trl_process(omp_passive=args.omp_passive)
    print_header(args)
    runners = {"rollout": run_rollout, "trl": run_trl}
    results: dict[str, list[Measurement]] = {lib: [] for lib in runners}
    with tempfile.TemporaryDirectory(prefix=f"{args.algo}-bench-") as tmp:
        work = Path(tmp)
        model_dir, data_path = prepare_inputs(work, args.algo)
        for repeat in range(args.repeats):
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for lib in order:
                with quiet_stderr():
                    m = runners[lib](work / f"{lib}-{repeat}", model_dir, data_path, args)
                results[lib].append(m)
                print(f"repeat {repeat + 1}/{args.repeats} {lib:<8} {m.steps_per_s:6.2f} steps/s, "
                      f"{m.tokens / m.steps:,.0f} tokens/step, final loss {m.final_loss:.3f}", flush=True)
    ours = statistics.median(m.steps_per_s for m in results["rollout"])
    theirs = statistics.median(m.steps_per_s for m in results["trl"])
    per_repeat = " ".join(f"{a.steps_per_s / b.steps_per_s:.2f}"
                          for a, b in zip(results["rollout"], results["trl"], strict=True))
    print(f"\nrollout {ours:.2f} steps/s, TRL {theirs:.2f} steps/s: {ours / theirs:.2f}x (per repeat {per_repeat}); "
          f"load avg at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
