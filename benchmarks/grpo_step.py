"""GRPO step time: rollout (on-policy and one-step off-policy) vs TRL's `GRPOTrainer`, same model and settings (CPU).

    .venv/bin/python benchmarks/grpo_step.py                        # default: ~2.5 minutes on 2 cores
    .venv/bin/python benchmarks/grpo_step.py --steps 60 --repeats 1 --runs rollout,trl   # quick look, ~1 minute
    .venv/bin/python benchmarks/grpo_step.py --model-dir local/models/sft-warmup   # skip the SFT warm-up
    .venv/bin/python benchmarks/grpo_step.py --threads 2 --omp-passive   # 2 intra-op threads each

One run makes the arithmetic data (`rollout data arithmetic`) and an SFT-warmed
tiny Qwen2 (~1.05M params: `init_tiny_model`, then rollout SFT with the settings
of examples/sft-warmup.toml, exported to a temp folder; `--model-dir` reuses an
existing one), then trains GRPO from it on `prompts.jsonl` three ways:

  rollout      `rollout.algorithms.grpo.train_grpo`, `off_policy_steps = 0` (generate, then train);
  rollout-op1  the same with `off_policy_steps = 1` (the next batch is generated while this one trains);
  rollout-packed / rollout-cache  `rollout` with the training pass's layout forced (`models/prefix.py`:
               each prompt with its completions in one packed row, or the prompt pass then the
               completion pass on its cache) instead of chosen by estimated cost: a layout A/B;
  trl          `trl.GRPOTrainer`, plain transformers generation (`use_vllm=False`);

and prints seconds per optimizer step for each, the ratio TRL / rollout (higher
is better for rollout), where the time goes, and the mean sampled reward over
the first and the last `--reward-window` steps. Repeat r runs every library with
seed r (so the rewards are compared over seeds, not one lucky draw: at 2 prompts
per step and lr 1e-3 single runs of both libraries sometimes collapse to reward
~0), and alternates the order of the runs; medians over repeats are reported.
The libraries sample their own completions, so their reward curves also differ by
chance; `grpo_trl_parity.py` compares the update itself on one batch TRL sampled.

Held equal (the header says it again):

- the same model folder, float32, sdpa; the same prompt rows (`prompt`: a user
  message rendered with the ChatML template and the generation prompt; `answer`);
- `--prompts` prompts x `--generations` completions per optimizer step, one
  generation per step, no gradient accumulation. TRL counts its batch in
  completions: `per_device_train_batch_size = prompts * generations`,
  `num_generations = generations`; `steps_per_generation` defaults to
  `gradient_accumulation_steps` = 1, so `generation_batch_size` = the same 16;
- sampling: temperature 1.0, top_p 1, top_k off, at most `--max-tokens`
  completion tokens, stopping at `<|im_end|>`;
- the reward: `rollout.tasks.arithmetic.is_correct(completion, answer)` (1 or 0)
  -- rollout's built-in `arithmetic_correct`; for TRL the same function wrapped
  as a TRL reward function of `completions` and the `answer` column;
- the loss: GRPO clipped surrogate, eps 0.2 both sides (rollout clip_low =
  clip_high = 0.2; TRL epsilon 0.2, epsilon_high unset), beta 0 (no reference
  model on either side), `num_iterations = 1`, advantages scaled by the group's
  (Bessel) std (`scale_rewards = "group"` both), token-mean aggregation (rollout
  `loss_agg = "token_mean"`, TRL `loss_type = "dapo"`: both divide by the
  step's completion tokens); no dynamic sampling (rollout `dynamic_sampling =
  false`: every group trains, even with equal rewards);
- AdamW lr 1e-3, constant, no warmup, clipping at 1.0, the repeat's seed; float32
  (TRL `bf16=False`), no activation checkpointing;
- `--steps` optimizer steps and `--threads` torch intra-op threads.

Differences that are part of each library's design: rollout leaves the rows
whose gradient is exactly zero out of its training pass (`skip_zero_advantage`,
its default: a group of equal rewards has advantage 0 with beta 0; the step's
normaliser still counts them, so the gradient is the same up to float
reassociation, `tests/integration/test_grpo.py`), TRL runs every row; at this
step's rewards (~0.1) that is 51-78% of the rows and 25-62% of the steps whole
(five seeds, 2026-12-02). rollout samples with its
own engine (on-policy it shares the policy's parameter tensors, so nothing is
copied; with `off_policy_steps = 1` a second copy, updated after every step)
and keeps the engine's per-token log-probs for truncated importance sampling
(`tis_cap` 2.0, a no-op on-policy); TRL generates with `model.generate` on the
policy itself. rollout records per-step metrics and events in its store; TRL
keeps its metrics in memory (`logging_steps` past the end, `report_to=[]`).
Both run torch's fused AdamW kernel (rollout: `fused=True`, `make_optimizer`; TRL: its
default `optim="adamw_torch_fused"`). With `off_policy_steps = 1` rollout
generates in a second thread while the main thread trains, so it can use two
cores even with `--threads 1` -- when a second core is free: on a machine that
other processes keep busy the two threads only take turns.

Timed: seconds per step = (end of step N - end of step warmup) / (N - warmup),
after model loading and `--warmup-steps` steps. rollout: its `train_step`
events; TRL: a `TrainerCallback` stamping `on_step_end`. Where the time goes,
in seconds per timed step: "generate" = inside the generate call (rollout's
`rollout/generation_s`; a wrapper around TRL's `_generate_single_turn`);
"sample+score" = the loop waiting for its scored batch (rollout's
`perf/generation_wait_s`, the weight push to the engine included; TRL's
`_generate_and_score_completions`); "rest" = s/step - sample+score (forward,
backward, optimizer and the loop's own work); "train" = rollout's
`perf/train_s` (forward, backward, optimizer). With `off_policy_steps = 1`
generation overlaps training, so "generate" is no longer part of the step.

On a machine where other processes keep the cores busy every figure is slower
and noisier; the header notes the load. Compare runs within one invocation.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import (
    MODEL_SIZES,
    add_cpu_matmul_arg,
    add_precision_args,
    no_activation_checkpointing,
    prepare_trl_process,
    quiet_stderr,
    torch_dtype,
    trl_precision,
)

LR = 1e-3
CLIP = 0.2
RUNS = ("rollout", "rollout-op1", "trl", "rollout-packed", "rollout-cache")


@dataclass(frozen=True)
class Measurement:
    """One GRPO run: its timed window and its per-step rewards."""

    steps: int  # optimizer steps inside the timed window
    seconds: float
    rewards: list[float]  # mean sampled reward of every step, 1..N
    generation_s: float  # mean per timed step: inside the generate call
    sample_s: float  # mean per timed step: the loop waiting for its scored batch (generate + score)
    train_s: float | None = None  # rollout: mean per timed step, forward/backward/optimizer
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def s_per_step(self) -> float:
        return self.seconds / self.steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    p.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the timed window (default 10)"
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step (default 2)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="max completion tokens (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for all (default 1)")
    add_cpu_matmul_arg(p)
    p.add_argument(
        "--repeats", type=int, default=2, help="runs per library, repeat r with seed r; medians (default 2)"
    )
    p.add_argument(
        "--reward-window", type=int, default=50, help="steps averaged for the first/last reward (default 50)"
    )
    p.add_argument("--runs", default=",".join(RUNS[:3]), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="start from this SFT-warmed model folder (e.g. local/models/sft-warmup) instead of making one",
    )
    p.add_argument(
        "--model",
        choices=tuple(MODEL_SIZES),
        default="tiny",
        help="tiny (default): SFT-warmed as above; mid ~48M / large ~190M: random weights, no warm-up "
        "(rewards stay ~0 and every completion runs to --max-tokens: a step-time figure only, for --device cuda)",
    )
    add_precision_args(p)
    p.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="CUDA: keep torch's SDPA off its cuDNN backend, for both libraries (flash / memory-efficient / math)",
    )
    p.add_argument(
        "--omp-passive",
        action="store_true",
        help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning): "
        "steadier figures on a machine that other processes keep busy",
    )
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "max_tokens", "threads", "repeats", "reward_window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.generations < 2:
        p.error("--generations must be >= 2 (GRPO advantages are relative to the group)")
    if args.warmup_steps < 1 or args.steps < args.warmup_steps + 5:
        p.error("--steps must exceed --warmup-steps (>= 1) by at least 5")
    if args.reward_window > args.steps:
        p.error("--reward-window must be <= --steps")
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or any(r not in RUNS for r in args.runs):
        p.error(f"--runs: choose from {', '.join(RUNS)}")
    if args.model_dir is not None:
        if not (args.model_dir / "config.json").is_file():
            p.error(f"--model-dir {args.model_dir}: not a model folder (no config.json)")
        args.model_dir = args.model_dir.resolve()
    return args


# --------------------------------------------------------------------------- inputs

SFT_WARMUP_TOML = """\
# examples/sft-warmup.toml's settings, storage and export in the benchmark's temp folder
schema_version = 1
seed = 0

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
minibatch_size = 32
gradient_accumulation = 1
[algorithm.sft.base_model]
uri = "{model_dir}"
dtype = "float32"
[algorithm.sft.optimizer]
kind = "adamw"
lr = 3e-3
[algorithm.sft.scheduler]
kind = "cosine"
warmup_steps = 10
min_lr_ratio = 1.0
[algorithm.sft.budget]
max_steps = 80
[algorithm.sft.dataset]
kind = "jsonl_path"
path = "{data_path}"
[algorithm.sft.packing]
kind = "off"
max_seq_len = 64
[algorithm.sft.loss_on]
kind = "assistant"
[algorithm.sft.snapshot]
every_steps = 1000
keep_last = 1
[algorithm.sft.export]
dir = "{export_dir}"

[backend]
kind = "torch"
device = "cpu"
num_threads = {threads}

[distributed]
kind = "local"
"""


def prepare_inputs(work: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(SFT-warmed model folder, prompts.jsonl, eval_prompts.jsonl), made fresh under `work` unless given."""
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    data = write_arithmetic_dataset(work / "data")
    if args.model_dir is not None:
        return args.model_dir, data["prompts"], data["eval_prompts"]

    from rollout.algorithms.sft import train_sft
    from rollout.config import load_config
    from rollout.models.tiny import init_tiny_model

    if args.model != "tiny":
        return init_tiny_model(work / args.model, **MODEL_SIZES[args.model]), data["prompts"], data["eval_prompts"]

    tiny = init_tiny_model(work / "tiny", force=True)
    sft_work = work / "sft-warmup-run"
    sft_work.mkdir()
    export_dir = work / "sft-warmup"
    config_path = sft_work / "sft-warmup.toml"
    config_path.write_text(
        SFT_WARMUP_TOML.format(
            work=sft_work, model_dir=tiny, data_path=data["sft"], export_dir=export_dir, threads=args.threads
        )
    )
    t0 = time.perf_counter()
    with quiet_stderr():
        train_sft(load_config(config_path))
    print(
        f"SFT warm-up (examples/sft-warmup.toml settings, 80 steps): {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return export_dir, data["prompts"], data["eval_prompts"]


def greedy_eval_accuracy(model_dir: Path, eval_prompts: Path) -> float:
    """Greedy accuracy of a model folder on the eval prompts: how far the warm-up got."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.tasks.arithmetic import greedy_accuracy

    rows = [
        json.loads(line) for line in eval_prompts.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return greedy_accuracy(model, AutoTokenizer.from_pretrained(model_dir), rows)


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
kind = "grpo"
[algorithm.grpo]
minibatch_size = {prompts}            # prompts per step
num_generations = {generations}
gradient_accumulation = 1
max_grad_norm = 1.0
max_tokens = {max_tokens}
temperature = 1.0
top_p = 1.0
top_k = 0
beta = 0.0
scale_rewards = "group"
clip_low = {clip}
clip_high = {clip}
loss_agg = "token_mean"
num_iterations = 1
dynamic_sampling = false
off_policy_steps = {off_policy_steps}
[[algorithm.grpo.rewards]]
name = "arithmetic_correct"
weight = 1.0
[algorithm.grpo.base_model]
uri = "{model_dir}"
dtype = "{dtype}"
[algorithm.grpo.optimizer]
kind = "adamw"
lr = {lr}
[algorithm.grpo.scheduler]
kind = "constant"
warmup_steps = 0
[algorithm.grpo.budget]
max_steps = {steps}
[algorithm.grpo.dataset]
kind = "jsonl_path"
path = "{data_path}"
[algorithm.grpo.packing]
kind = "off"
max_seq_len = 64
[algorithm.grpo.snapshot]
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
    work: Path,
    model_dir: Path,
    data_path: Path,
    args: argparse.Namespace,
    *,
    seed: int,
    off_policy_steps: int,
    layout: str | None = None,
) -> Measurement:
    from rollout.algorithms.grpo import train_grpo
    from rollout.config import load_config
    from rollout.store import open_store

    work.mkdir(parents=True)
    config_path = work / "grpo.toml"
    config_path.write_text(
        ROLLOUT_TOML.format(
            seed=seed,
            work=work,
            model_dir=model_dir,
            data_path=data_path,
            prompts=args.prompts,
            generations=args.generations,
            max_tokens=args.max_tokens,
            clip=CLIP,
            off_policy_steps=off_policy_steps,
            lr=LR,
            steps=args.steps,
            threads=args.threads,
            cpu_matmul=args.cpu_matmul,
            dtype=args.dtype,
            device=args.device,
        )
    )
    if layout is None:
        result = train_grpo(load_config(config_path))
    else:  # the training pass's layout forced: packed rows, or the prompt pass + completion pass
        from rollout.models import prefix

        chosen = prefix.packed_layout
        prefix.packed_layout = functools.partial(chosen, force=layout == "packed")
        try:
            result = train_grpo(load_config(config_path))
        finally:
            prefix.packed_layout = chosen
    store = open_store("embedded", path=work / "rollout.db")
    try:
        step_end = {
            e.fields["step"]: e.time for e in store.read_events(result.run_id) if e.name == "train_step"
        }
        metrics: dict[str, dict[int, float]] = {}
        for m in store.read_metrics(result.run_id):
            metrics.setdefault(m.name, {})[m.step] = m.value
    finally:
        store.close()
    first, last = args.warmup_steps, result.steps
    assert last == args.steps, f"rollout stopped after {last} of {args.steps} steps"
    timed = range(first + 1, last + 1)

    def window_mean(name: str) -> float:
        return statistics.fmean(metrics[name][s] for s in timed)

    return Measurement(
        steps=last - first,
        seconds=step_end[last] - step_end[first],
        rewards=[metrics["rollout/reward_mean"][s] for s in range(1, last + 1)],
        generation_s=window_mean("rollout/generation_s"),
        sample_s=window_mean("perf/generation_wait_s"),
        train_s=window_mean("perf/train_s"),
        extra={"completion_len": window_mean("rollout/completion_len_mean")},
    )


# --------------------------------------------------------------------------- TRL


def trl_dataset(data_path: Path) -> Any:
    """The prompt rows as TRL's `GRPOTrainer` takes them: `prompt` and the `answer` column its reward reads."""
    from datasets import Dataset

    with data_path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def trl_scores(completions: list, answer: list) -> list[float]:
    """rollout's `arithmetic_correct`, TRL-shaped: completions are message lists for conversational prompts."""
    from rollout.tasks.arithmetic import is_correct

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if is_correct(t, str(a)) else 0.0 for t, a in zip(texts, answer, strict=True)]


def trl_config(work: Path, args: argparse.Namespace, *, seed: int) -> Any:
    """TRL's `GRPOConfig` held equal to rollout's run (the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work),
        seed=seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.generations,  # completions, not prompts
        num_generations=args.generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        epsilon=CLIP,
        num_iterations=1,
        scale_rewards="group",
        loss_type="dapo",  # token mean over the step's completion tokens
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        **trl_precision(args),
        dataloader_num_workers=0,
        report_to=[],
        logging_steps=10 * args.steps,
        save_strategy="no",
        disable_tqdm=True,
        **no_activation_checkpointing(GRPOConfig),
    )


def run_trl(
    work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace, *, seed: int
) -> Measurement:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    dataset = trl_dataset(data_path)
    step_rewards: list[float] = []
    lengths: list[float] = []

    def arithmetic_correct(completions: list, answer: list, **_: object) -> list[float]:
        scores = trl_scores(completions, answer)
        step_rewards.append(statistics.fmean(scores))  # one call per generation batch = per step
        return scores

    batch = args.prompts * args.generations
    config = trl_config(work, args, seed=seed)
    load = {"dtype": torch_dtype(args), "attn_implementation": "sdpa"}
    policy = AutoModelForCausalLM.from_pretrained(model_dir, **load)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[arithmetic_correct],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    model = trainer.model
    assert trainer.ref_model is None, "TRL loaded a reference model with beta = 0"
    gen = trainer.generation_config
    assert gen.do_sample and gen.temperature == 1.0 and gen.top_k in (0, None) and gen.top_p == 1.0, gen
    assert gen.max_new_tokens == args.max_tokens, gen
    assert model.dtype == torch_dtype(args) and model.config._attn_implementation == "sdpa"
    checkpointing = "is_activation_checkpointing"
    if not hasattr(type(model), checkpointing):
        checkpointing = "is_gradient_checkpointing"
    assert not getattr(model, checkpointing), "TRL turned on activation checkpointing"
    assert trainer.args.generation_batch_size == batch and trainer.args.steps_per_generation == 1, (
        f"TRL generation batch {trainer.args.generation_batch_size}, steps/generation {trainer.args.steps_per_generation}"
    )

    gen_times: list[float] = []
    sample_times: list[float] = []
    generate = trainer._generate_single_turn
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a: object, **kw: object):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = generate_and_score(*a, **kw)
        sample_times.append(time.perf_counter() - t0)
        return out

    def timed_generate(*a: object, **kw: object):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        lengths.append(statistics.fmean(len(c) for c in out[0]))
        return out

    trainer._generate_single_turn = timed_generate  # type: ignore[method-assign]
    trainer._generate_and_score_completions = timed_generate_and_score  # type: ignore[method-assign]
    marks: dict[int, float] = {}
    cuda = args.device == "cuda"

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if cuda and state.global_step in (args.warmup_steps, args.steps):
                torch.cuda.synchronize()  # the window's two ends only
            marks[state.global_step] = time.time()

    trainer.add_callback(StepClock())
    torch.set_num_threads(args.threads)
    trainer.train()
    first, last = args.warmup_steps, args.steps
    assert max(marks) == last and len(step_rewards) == last == len(gen_times), (
        f"TRL ran {max(marks)} steps, {len(step_rewards)} reward calls, {len(gen_times)} generations"
    )
    return Measurement(
        steps=last - first,
        seconds=marks[last] - marks[first],
        rewards=step_rewards,
        generation_s=statistics.fmean(gen_times[first:]),
        sample_s=statistics.fmean(sample_times[first:]),
        extra={"completion_len": statistics.fmean(lengths[first:])},
    )


# --------------------------------------------------------------------------- report


def print_header(args: argparse.Namespace) -> None:
    import platform

    import torch
    import transformers
    import trl

    import rollout

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    model = args.model_dir or (
        "SFT-warmed tiny Qwen2 ~1.05M params" if args.model == "tiny" else f"random {args.model} Qwen2"
    )
    where = "CPU" if args.device == "cpu" else f"CUDA {torch.cuda.get_device_name()}"
    print(f"GRPO step time: rollout vs TRL GRPOTrainer ({model}, arithmetic prompts, {where})")
    print(
        f"  versions: rollout {rollout.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"  steps {args.steps} (timed: {args.warmup_steps + 1}..{args.steps}), {args.prompts} prompts x "
        f"{args.generations} generations x <={args.max_tokens} tokens per step, threads {args.threads}, "
        f"repeats {args.repeats}; cpus {os.cpu_count()}, load avg {load}, "
        f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        f"  both: temperature 1, clip eps {CLIP}, beta 0, 1 iteration, group-std advantages, token-mean loss, "
        f"no dynamic sampling, AdamW lr {LR:g} constant, clip-norm 1.0, {args.dtype}, sdpa; repeat r uses seed r"
    )
    print("  rollout leaves rows of advantage exactly 0 out of its passes (skip_zero_advantage: the same gradient)")
    print(
        "  s/step = wall seconds / timed steps; reward = mean sampled reward (is_correct) of the first / last "
        f"{args.reward_window} steps; median over repeats"
    )
    load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if (
        args.threads > 1
        and cpus - load1 < args.threads - 0.5
        and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE"
    ):
        print(
            f"  WARNING: load average {load1:.1f} on {cpus} cpus leaves ~{max(cpus - load1, 0):.1f} free for "
            f"{args.threads} threads: spinning OpenMP threads that share a core stall each other; "
            "re-run on an idle machine, or add --omp-passive, or use --threads 1."
        )
    elif load1 > cpus - 0.5:
        print(f"  note: load average {load1:.1f} on {cpus} cpus: slower and noisier than on an idle machine")
    print(flush=True)


def print_table(results: dict[str, list[Measurement]], args: argparse.Namespace) -> None:
    w = args.reward_window
    reference = statistics.median(m.s_per_step for m in results["trl"]) if "trl" in results else None
    print()
    print(
        f"{'run':<14} | {'s/step':>6} | {'TRL/this':>8} | {'generate':>8} | {'sample+score':>12} | "
        f"{'rest':>6} | {'train':>6} | {'tokens/compl':>12} | {f'reward first {w}':>15} | {f'reward last {w}':>14}"
    )
    print("-" * 128)
    for run, ms in results.items():
        sps = statistics.median(m.s_per_step for m in ms)
        ratio = f"{reference / sps:.2f}x" if reference is not None else "-"
        train = [m.train_s for m in ms if m.train_s is not None]
        print(
            f"{run:<14} | {sps:>6.3f} | {ratio:>8} | {statistics.median(m.generation_s for m in ms):>8.3f} | "
            f"{statistics.median(m.sample_s for m in ms):>12.3f} | "
            f"{statistics.median(m.s_per_step - m.sample_s for m in ms):>6.3f} | "
            f"{f'{statistics.median(train):.3f}' if train else '-':>6} | "
            f"{statistics.median(m.extra['completion_len'] for m in ms):>12.2f} | "
            f"{statistics.median(statistics.fmean(m.rewards[:w]) for m in ms):>15.3f} | "
            f"{statistics.median(statistics.fmean(m.rewards[-w:]) for m in ms):>14.3f}"
        )
    print(
        "\nseconds per step (medians): generate = inside the generate call; sample+score = the loop waiting for "
        "its scored batch\n(rollout: perf/generation_wait_s, weight push included; TRL: _generate_and_score_completions); "
        "rest = s/step - sample+score;\ntrain = rollout's perf/train_s (forward, backward, optimizer)"
    )
    print(f"load avg at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


# --------------------------------------------------------------------------- main




def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_trl_process(omp_passive=args.omp_passive)
    print_header(args)
    if args.no_cudnn_attention:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
        print("  SDPA's cuDNN backend off for both\n", flush=True)

    runners = {
        "rollout": functools.partial(run_rollout, off_policy_steps=0),
        "rollout-op1": functools.partial(run_rollout, off_policy_steps=1),
        "rollout-packed": functools.partial(run_rollout, off_policy_steps=0, layout="packed"),
        "rollout-cache": functools.partial(run_rollout, off_policy_steps=0, layout="cache"),
        "trl": run_trl,
    }
    runners = {name: fn for name, fn in runners.items() if name in args.runs}
    results: dict[str, list[Measurement]] = {name: [] for name in runners}
    with tempfile.TemporaryDirectory(prefix="grpo-step-") as tmp:
        work = Path(tmp)
        model_dir, prompts_path, eval_path = prepare_inputs(work, args)
        if args.model == "tiny" or args.model_dir is not None:
            with quiet_stderr():  # the weight-loading progress bar
                accuracy = greedy_eval_accuracy(model_dir, eval_path)
            print(f"start model: greedy accuracy {accuracy:.3f} on eval_prompts.jsonl\n", flush=True)
        for repeat in range(args.repeats):
            # alternate the order, so a load change drifts onto every run
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for name in order:
                with quiet_stderr():  # progress lines of both libraries
                    m = runners[name](work / f"{name}-{repeat}", model_dir, prompts_path, args, seed=repeat)
                results[name].append(m)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {name:<11} {m.s_per_step:.3f} s/step "
                    f"({m.steps} steps in {m.seconds:.2f}s; generate {m.generation_s:.3f}, "
                    f"sample+score {m.sample_s:.3f}), reward "
                    f"first/last {args.reward_window}: {statistics.fmean(m.rewards[: args.reward_window]):.3f} / "
                    f"{statistics.fmean(m.rewards[-args.reward_window :]):.3f}, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
