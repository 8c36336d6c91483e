"""`make bench`: every benchmark against its peer, interleaved, at 1 and 2 threads, one table.

    .venv/bin/python benchmarks/run_all.py --quick                 # ~15-20 min on 2 cores: short runs, 3-4 repeats
    .venv/bin/python benchmarks/run_all.py                         # longer runs, 3-7 repeats (~45 min)
    .venv/bin/python benchmarks/run_all.py --quick --only sft,dpo --threads 1   # a subset
    make bench                                                     # installs the [bench] extra, runs --quick

Jobs (each reuses its script's own runner functions and settings, see their docstrings):

| job | sides | figure | target (issue 14) |
|---|---|---|---|
| `sft-padded` | rollout, TRL `SFTTrainer`, bare PyTorch | tokens/s | rollout >= 0.95 x bare |
| `sft-packed` | rollout bfd, TRL bfd (padding-free), bare PyTorch (the same bfd rows) | tokens/s | rollout >= 0.95 x bare, >= 2 x TRL, and >= 2 x TRL padded |
| `sft-mixed` | rollout bfd, TRL padded, on arithmetic + guess-number games (17-245 tokens, `--data mixed`) | tokens/s | rollout >= 2 x TRL padded |
| `dpo` | rollout, TRL `DPOTrainer`, bare PyTorch | steps/s | rollout >= 1.5 x TRL (bare: for reference) |
| `rm` | rollout, TRL `RewardTrainer` (`rm_kto_throughput.py --algo rm`) | steps/s | (none set) |
| `kto` | rollout, TRL `KTOTrainer` (`rm_kto_throughput.py --algo kto`) | steps/s | (none set) |
| `grpo` | rollout (on-policy; rows of advantage 0 skip its passes, the same gradient), TRL `GRPOTrainer` (2 prompts x 8, <= 8 tokens) | s/step | TRL / rollout >= 2 |
| `grpo-learn` | the same at the demo's batch (16 prompts x 8, <= 6 tokens), where the policy learns | s/step, reward | TRL / rollout >= 2, and rollout's last-steps reward >= TRL's (or a tie: the seeds' 95% interval of the difference holds 0) |
| `generation` | rollout hf engine, `model.generate` batched (48M model, 16 prompts) | tokens/s | >= 1.5 x |
| `serving` | `rollout serve`, `transformers serve --continuous-batching` (48M model, 16 concurrent HTTP clients) | tokens/s | (none set) |
| `multiturn` | rollout episodes (kept KV caches), the same without them, a naive re-prefill loop, TRL `GRPOTrainer(tools=)` | episodes/s | >= 2 x naive (issue 10) |
| `startup` | `rollout --help`, `rollout validate` (fresh interpreters) | seconds | < 0.3 s |

Interleaving: every job runs in its own process per thread count (OpenMP is set up
when torch loads), prepares its inputs once, then runs repeats; a repeat runs every
side of the job once, back to back, alternating the order (A B C, C B A, ...), so a
change in the machine's load falls on all sides alike. The ratio reported is the median
of the per-repeat ratios (each from sides that ran back to back); min/median/max are
over the repeats. Repeats go on until the medians of the job's targeted ratios are stable
(each moved < 2% with the last repeat) after `--min-repeats`, up to `--max-repeats`, or until
the job's share of `--budget-min` is spent. A ratio whose median lies within 10% of its target,
or whose repeats so far fall on both sides of it, is close (one more repeat could flip its
verdict): while one is, stability does not end the job,
which repeats on up to `--close-repeats` (6 quick, 9 full) as long as twice its share lasts.
OpenMP threads keep torch's default (`OMP_WAIT_POLICY` unset: idle
threads spin a while before they sleep), as users run it; `--omp-passive` sets PASSIVE (idle
threads sleep at once), which steadies figures on a machine that other processes keep busy but
made every 2-thread figure ~1.5-2x slower for both sides on the 2-core VMs and hid a slowdown
only spinning threads showed (two OpenMP teams waking each other: benchmarks/README.md).

Writes `benchmarks/results/<date>-<host>.md` (the table, the commit, versions, load average, and which kind
of machine it is: `machine.py`'s CPU, vector ISA, caches and one-thread kernel figures, measured
first) and `.json` (every repeat's figures) unless `--no-write`. The startup table also times the
references beside `rollout --help` (`python -c pass`, `import typer`, a bare typer app's `--help`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import add_cpu_matmul_arg
from machine import summary_line

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = ("startup", "sft", "sft-mixed", "dpo", "rm", "kto", "grpo", "grpo-learn", "generation", "serving", "multiturn")
WEIGHTS = {"startup": 0.05, "sft": 0.2, "sft-mixed": 0.08, "dpo": 0.12, "rm": 0.05, "kto": 0.05, "grpo": 0.14,
           "grpo-learn": 0.13, "generation": 0.07, "serving": 0.05, "multiturn": 0.06}
"""Each job's share of --budget-min, per thread count (startup runs once)."""
STABLE = 0.02
CLOSE = 0.10
"""A ratio whose median is within this fraction of its target is close: its verdict is not settled."""
RESULT_PREFIX = "RESULT "

# job settings: (quick, full)
SFT_STEPS = (40, 120)
SFT_MIXED_STEPS = (20, 60)
DPO_STEPS = (40, 120)
RM_KTO_STEPS = (40, 120)
GRPO_STEPS = (40, 100)
GRPO_LEARN_STEPS = (60, 120)
GRPO_LEARN = ("--prompts", "16", "--generations", "8", "--max-tokens", "6")  # examples/grpo-tiny.toml's batch
REWARD_WINDOW = 20
GEN_PROMPTS, GEN_TOKENS = (16, 16), (16, 32)
SERVE_CLIENTS, SERVE_REQUESTS = 16, (2, 4)  # concurrent clients; requests each (quick, full), GEN_TOKENS each
MULTITURN_EPISODES = (16, 32)
STARTUP_RUNS = (8, 20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs, fewer repeats (~15 min on 2 cores)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (default 1,2)")
    p.add_argument("--only", default=",".join(JOBS), help=f"comma-separated subset of {','.join(JOBS)}")
    p.add_argument("--budget-min", type=float, help="total minutes to aim for (default 15 quick, 45 full)")
    p.add_argument("--min-repeats", type=int, help="default 3")
    p.add_argument("--max-repeats", type=int, help="default 4 quick, 7 full")
    p.add_argument("--close-repeats", type=int,
                   help="the cap while a ratio is within 10%% of its target (default 6 quick, 9 full)")
    add_cpu_matmul_arg(p, "the sft, sft-mixed, dpo and grpo jobs' training products")
    p.add_argument("--omp-passive", action="store_true",
                   help="set OMP_WAIT_POLICY=PASSIVE (default: unset, OpenMP's spinning, as users run)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for the .md and .json")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--worker", choices=("machine", *JOBS), help=argparse.SUPPRESS)  # one job, one thread count
    p.add_argument("--budget-s", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    args.only = [j.strip() for j in args.only.split(",") if j.strip()]
    if any(j not in JOBS for j in args.only):
        p.error(f"--only: choose from {', '.join(JOBS)}")
    args.budget_min = args.budget_min or (15.0 if args.quick else 45.0)
    args.min_repeats = args.min_repeats or 3
    args.max_repeats = max(args.max_repeats or (4 if args.quick else 7), args.min_repeats)
    args.close_repeats = max(args.close_repeats or (6 if args.quick else 9), args.max_repeats)
    return args


# --------------------------------------------------------------------------- one job (worker process)


def unsettled(values: list[float], target: float) -> bool:
    """Whether one more repeat could flip a ratio's verdict: its median lies within `CLOSE` of the
    target, or its repeats so far fall on both sides of it (a noisy 2-thread row whose median is
    0.80 with repeats 0.72-0.98 against a 0.95 target is not a settled "NO")."""
    median = statistics.median(values)
    return abs(median / target - 1) < CLOSE or min(values) < target <= max(values)


class Repeats:
    """Runs `sides` (name -> zero-argument function returning a figure) repeat by repeat, in
    alternating order, until the medians of the per-repeat ratios `ratio(figures)` are stable and
    none is close to its target (`TARGETS`, `CLOSE`), or a cap or the budget is reached."""

    def __init__(self, args: argparse.Namespace, label: str) -> None:
        self.args, self.label = args, label
        self.started = time.perf_counter()

    def run(self, sides: dict[str, Any], ratios: dict[str, Any]) -> dict[str, Any]:
        figures: dict[str, list[float]] = {name: [] for name in sides}
        per_repeat: dict[str, list[float]] = {name: [] for name in ratios}
        extra: dict[str, list[Any]] = {name: [] for name in sides}
        loads: list[float] = []
        previous: dict[str, float] | None = None
        targets = {name: TARGETS[self.label, name] for name in ratios if (self.label, name) in TARGETS}
        watched = list(targets) or list(ratios)[:1]  # whose medians must be stable
        for repeat in range(self.args.close_repeats):
            t0 = time.perf_counter()
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in order:
                value, info = sides[name](repeat)
                figures[name].append(value)
                extra[name].append(info)
                print(f"  [{self.label}] repeat {repeat + 1} {name:<16} {value:10.4g}  load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
            loads.append(os.getloadavg()[0])
            for name, fn in ratios.items():
                per_repeat[name].append(fn({k: v[-1] for k, v in figures.items()}))
            medians = {name: statistics.median(values) for name, values in per_repeat.items()}
            done, used = repeat + 1, time.perf_counter() - self.started
            last_took = time.perf_counter() - t0
            stable = previous is not None and all(
                abs(medians[name] - previous[name]) <= STABLE * abs(previous[name]) for name in watched)
            previous = medians
            close = any(unsettled(per_repeat[name], t) for name, t in targets.items())
            if done >= self.args.min_repeats and (
                (stable and not close) or done >= (self.args.close_repeats if close else self.args.max_repeats)
                or used + last_took > self.args.budget_s * (2 if close else 1)
            ):
                break
            if used + last_took > 2 * self.args.budget_s:  # far over its share: stop even before min
                break
        return {"figures": figures, "ratios": per_repeat, "extra": extra, "load": loads,
                "seconds": time.perf_counter() - self.started}


def job_sft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import bare_loop
    import sft_throughput as sft

    steps = SFT_STEPS[0 if args.quick else 1]
    a = sft.parse_args(["--steps", str(steps), "--threads", str(args.threads[0]), "--repeats", "1", "--cpu-matmul", args.cpu_matmul])
    model_dir, data_path = sft.prepare_inputs(work)
    out = {}
    for mode, runners in (
        ("padded", {"rollout": sft.run_rollout, "trl": sft.run_trl, "bare": bare_loop.run_bare_sft}),
        ("packed", {"rollout": sft.run_rollout, "trl": sft.run_trl, "bare": bare_loop.run_bare_sft}),
    ):
        def side(fn: Any, name: str, mode: str = mode) -> Any:
            def call(repeat: int) -> tuple[float, dict[str, float]]:
                with sft.quiet_stderr():
                    m = fn(work / f"{name}-{mode}-{repeat}", model_dir, data_path, a, packed=mode == "packed")
                return m.tokens_per_s, {"final_loss": m.final_loss}
            return call

        sides = {name: side(fn, name) for name, fn in runners.items()}
        ratios = {"rollout/trl": lambda f: f["rollout"] / f["trl"]}
        if "bare" in runners:
            ratios = {"rollout/bare": lambda f: f["rollout"] / f["bare"], **ratios,
                      "trl/bare": lambda f: f["trl"] / f["bare"]}
        out[f"sft-{mode}"] = Repeats(args, f"sft-{mode}").run(sides, ratios)
    return out


def job_sft_mixed(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import sft_throughput as sft

    steps = SFT_MIXED_STEPS[0 if args.quick else 1]
    a = sft.parse_args(["--steps", str(steps), "--threads", str(args.threads[0]), "--repeats", "1", "--data", "mixed", "--cpu-matmul", args.cpu_matmul])
    model_dir, data_path = sft.prepare_inputs(work, "mixed")

    def side(fn: Any, name: str, packed: bool) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            with sft.quiet_stderr():
                m = fn(work / f"{name}-{repeat}", model_dir, data_path, a, packed=packed)
            return m.tokens_per_s, {"final_loss": m.final_loss}
        return call

    sides = {"rollout": side(sft.run_rollout, "rollout", True), "trl padded": side(sft.run_trl, "trl", False)}
    ratios = {"rollout/trl padded": lambda f: f["rollout"] / f["trl padded"]}
    return {"sft-mixed": Repeats(args, "sft-mixed").run(sides, ratios)}


def job_dpo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import bare_loop
    import dpo_throughput as dpo

    steps = DPO_STEPS[0 if args.quick else 1]
    a = dpo.parse_args(["--steps", str(steps), "--threads", str(args.threads[0]), "--repeats", "1", "--cpu-matmul", args.cpu_matmul])
    model_dir, data_path = dpo.prepare_inputs(work, None)
    runners = {"rollout": dpo.run_rollout, "trl": dpo.run_trl, "bare": bare_loop.run_bare_dpo}

    def side(fn: Any, name: str) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            with dpo.quiet_stderr():
                m = fn(work / f"{name}-{repeat}", model_dir, data_path, a)
            return m.steps_per_s, {"final_loss": m.final_loss, "tokens_per_step": m.tokens / m.steps}
        return call

    ratios = {"rollout/trl": lambda f: f["rollout"] / f["trl"], "rollout/bare": lambda f: f["rollout"] / f["bare"],
              "trl/bare": lambda f: f["trl"] / f["bare"]}
    return {"dpo": Repeats(args, "dpo").run({n: side(fn, n) for n, fn in runners.items()}, ratios)}


def job_rm_kto(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import rm_kto_throughput as bench

    algo = args.worker
    steps = RM_KTO_STEPS[0 if args.quick else 1]
    a = bench.parse_args(["--algo", algo, "--steps", str(steps), "--threads", str(args.threads[0]), "--repeats", "1"])
    model_dir, data_path = bench.prepare_inputs(work, algo)
    runners = {"rollout": bench.run_rollout, "trl": bench.run_trl}

    def side(fn: Any, name: str) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            with bench.quiet_stderr():
                m = fn(work / f"{name}-{repeat}", model_dir, data_path, a)
            return m.steps_per_s, {"final_loss": m.final_loss, "tokens_per_step": m.tokens / m.steps}
        return call

    ratios = {"rollout/trl": lambda f: f["rollout"] / f["trl"]}
    return {algo: Repeats(args, algo).run({n: side(fn, n) for n, fn in runners.items()}, ratios)}


def job_grpo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The issue's step (2 prompts x 8, <= 8 tokens, 40/100 steps) or, as `grpo-learn`, the demo's
    batch (16 prompts x 8, <= 6 tokens, 60/120 steps), where the policy learns within the run: the
    sampled reward of the last `REWARD_WINDOW` steps is compared too (`render_markdown`)."""
    import grpo_step as grpo

    learn = args.worker == "grpo-learn"
    steps = (GRPO_LEARN_STEPS if learn else GRPO_STEPS)[0 if args.quick else 1]
    window = min(REWARD_WINDOW, steps // 2)
    a = grpo.parse_args(["--steps", str(steps), "--threads", str(args.threads[0]), "--repeats", "1",
                         "--cpu-matmul", args.cpu_matmul,
                         "--reward-window", str(window), *(GRPO_LEARN if learn else ())])
    with grpo.quiet_stderr():
        model_dir, prompts_path, _ = grpo.prepare_inputs(work, a)
    runners = {"rollout": lambda *x, **k: grpo.run_rollout(*x, **k, off_policy_steps=0), "trl": grpo.run_trl}

    def side(fn: Any, name: str) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            with grpo.quiet_stderr():
                m = fn(work / f"{name}-{repeat}", model_dir, prompts_path, a, seed=repeat)
            return m.s_per_step, {"generation_s": m.generation_s, "sample_s": m.sample_s,
                                  "reward_first": statistics.fmean(m.rewards[:window]),
                                  "reward_last": statistics.fmean(m.rewards[-window:]), "steps": steps}
        return call

    ratios = {"trl/rollout (s/step)": lambda f: f["trl"] / f["rollout"]}
    label = args.worker or "grpo"
    return {label: Repeats(args, label).run({n: side(fn, n) for n, fn in runners.items()}, ratios)}


def job_generation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import generation as gen
    import torch

    torch.set_num_threads(args.threads[0])
    prompts_n, tokens = GEN_PROMPTS[0 if args.quick else 1], GEN_TOKENS[0 if args.quick else 1]
    model_dir = gen.make_model(ROOT / "local" / "bench-generation", "mid")
    prompts = gen.make_prompts(prompts_n)
    precision = gen.parse_args([])  # CPU, float32

    def side(fn: Any) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            with gen_quiet():
                n, seconds = fn(model_dir, prompts, tokens, precision)
            return n / seconds, {"tokens": n}
        return call

    sides = {"engine": side(gen.bench_engine),
             "generate-batched": side(lambda *x: gen.bench_hf_generate(*x, batched=True))}
    ratios = {"engine/generate": lambda f: f["engine"] / f["generate-batched"]}
    return {"generation": Repeats(args, "generation").run(sides, ratios)}


def job_serving(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both servers run for the whole job (idle while the other is timed); a repeat times each once."""
    import asyncio

    import generation as gen

    threads = args.threads[0]
    tokens = GEN_TOKENS[0 if args.quick else 1]
    per_client = SERVE_REQUESTS[0 if args.quick else 1]
    model_dir = gen.make_model(ROOT / "local" / "bench-generation", "mid")
    prompts = gen.make_prompts(SERVE_CLIENTS * per_client)
    ours, ours_url = gen.start_server(model_dir, threads)
    try:
        theirs, theirs_url = gen.start_transformers_server(model_dir, threads)
    except BaseException:
        gen.stop_server(ours)
        raise
    servers = {"rollout serve": (ours_url, model_dir.name, True),
               "transformers serve": (theirs_url, str(model_dir), False)}

    def side(name: str) -> Any:
        url, model, ignore_eos = servers[name]

        def call(repeat: int) -> tuple[float, dict[str, float]]:
            n, seconds = asyncio.run(gen._client_load(url, model, prompts, tokens, SERVE_CLIENTS, per_client,
                                                      ignore_eos=ignore_eos))
            return n / seconds, {"tokens": n}
        return call

    try:
        ratios = {"rollout/transformers": lambda f: f["rollout serve"] / f["transformers serve"]}
        return {"serving": Repeats(args, "serving").run({n: side(n) for n in servers}, ratios)}
    finally:
        gen.stop_server(ours)
        gen.stop_server(theirs)


def job_multiturn(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import multiturn as mt
    import torch

    torch.set_num_threads(args.threads[0])
    a = mt.parse_args(["--episodes", str(MULTITURN_EPISODES[0 if args.quick else 1]), "--threads",
                       str(args.threads[0]), "--variants", "rollout,no-kv,naive,trl"])
    rows = mt.make_rows(a.episodes // a.generations)
    variants = mt.prepare_variants(a, work, rows)

    def side(variant: Any) -> Any:
        def call(repeat: int) -> tuple[float, dict[str, float]]:
            run = variant.timed(rows, a.seed + repeat)
            return run.episodes_per_s, {"prefill_tokens": run.prefill_tokens, "prompt_tokens": run.prompt_tokens}
        return call

    ratios = {f"rollout/{name}": (lambda f, name=name: f["rollout"] / f[name]) for name in variants if name != "rollout"}
    return {"multiturn": Repeats(args, "multiturn").run({n: side(v) for n, v in variants.items()}, ratios)}


def gen_quiet() -> Any:
    from bench_common import quiet_stderr

    return quiet_stderr()


def job_machine(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import machine

    return {"machine": {"cpu": machine.describe_cpu(), "calibration": machine.calibrate()}}


def job_startup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import startup

    config = str(startup.prepare_config(work))
    env = startup.child_env(work / "pycache")
    commands = {**startup.reference_commands(), "--help": startup.rollout_command("--help"),
                "validate": startup.rollout_command("validate", "--config", config)}
    for command in commands.values():
        startup.run_once(command, env)  # warm-up: file cache, .pyc files
    out: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in commands}
    for _ in range(STARTUP_RUNS[0 if args.quick else 1]):
        for name, command in commands.items():
            wall, cpu = startup.run_once(command, env)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
    return {"startup": out}


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(HERE))
    if args.worker not in ("machine", "startup"):
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    job = {"machine": job_machine, "startup": job_startup, "sft": job_sft, "sft-mixed": job_sft_mixed,
           "dpo": job_dpo, "rm": job_rm_kto, "kto": job_rm_kto, "grpo": job_grpo, "grpo-learn": job_grpo,
           "generation": job_generation, "serving": job_serving, "multiturn": job_multiturn}[args.worker]
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.worker}-") as tmp:
        result = job(args, Path(tmp))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver


def run_worker(job: str, threads: int, budget_s: float, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", job, "--threads", str(threads),
           "--budget-s", f"{budget_s:.0f}", "--min-repeats", str(args.min_repeats),
           "--max-repeats", str(args.max_repeats), "--close-repeats", str(args.close_repeats),
           "--cpu-matmul", args.cpu_matmul,
           *(["--quick"] if args.quick else [])]
    env = dict(os.environ)
    if args.omp_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env.pop("OMP_WAIT_POLICY", None)
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0 or result is None:
        raise SystemExit(f"benchmark job {job} ({threads} threads) failed (exit {proc.returncode})")
    return result


TARGETS = {
    ("sft-padded", "rollout/bare"): 0.95,
    ("sft-packed", "rollout/bare"): 0.95,
    ("sft-packed", "rollout/trl"): 2.0,
    ("sft-packed", "rollout/trl padded"): 2.0,
    ("sft-mixed", "rollout/trl padded"): 2.0,
    ("dpo", "rollout/trl"): 1.5,
    ("dpo", "rollout/bare"): 0.95,
    ("grpo", "trl/rollout (s/step)"): 2.0,
    ("grpo-learn", "trl/rollout (s/step)"): 2.0,
    ("generation", "engine/generate"): 1.5,
    ("multiturn", "rollout/naive"): 2.0,
}
STARTUP_TARGET_S = 0.3
"""`rollout --help` and `rollout validate`: the median wall time a fresh interpreter takes, under this."""
UNITS = {"sft-padded": "tok/s", "sft-packed": "tok/s", "sft-mixed": "tok/s", "dpo": "steps/s", "rm": "steps/s",
         "kto": "steps/s", "grpo": "s/step", "grpo-learn": "s/step", "generation": "tok/s", "serving": "tok/s", "multiturn": "episodes/s"}


def summarize(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (job, threads, ratio): sides' min/median/max, the median per-repeat ratio, target."""
    rows = []
    for threads, jobs in results.items():
        if "sft-padded" in jobs and "sft-packed" in jobs:  # packed rollout vs TRL padded, repeat by repeat
            packed, padded = jobs["sft-packed"], jobs["sft-padded"]
            packed["ratios"]["rollout/trl padded"] = [
                a / b for a, b in zip(packed["figures"]["rollout"], padded["figures"]["trl"], strict=False)]
        for job, r in jobs.items():
            if job == "startup":
                continue
            sides = {name: _spread(v) for name, v in r["figures"].items()}
            for ratio, values in r["ratios"].items():
                target = TARGETS.get((job, ratio))
                median = statistics.median(values)
                rows.append({
                    "job": job, "threads": threads, "unit": UNITS[job], "sides": sides, "ratio": ratio,
                    "ratio_spread": _spread(values), "median_ratio": median, "target": target,
                    "met": None if target is None else median >= target, "repeats": len(values),
                    "load": _spread(r["load"]), "extra": r["extra"],
                })
    return rows


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-9); the normal's 1.96 past that
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def paired_interval(diffs: list[float]) -> tuple[float, float]:
    """The 95% interval of the mean of per-seed differences (Student's t); (-inf, inf) for one seed."""
    if len(diffs) < 2:
        return float("-inf"), float("inf")
    t = T_975[len(diffs) - 2] if len(diffs) - 1 <= len(T_975) else 1.96
    half = t * statistics.stdev(diffs) / len(diffs) ** 0.5
    mean = statistics.fmean(diffs)
    return mean - half, mean + half


def reward_comparison(extra: dict[str, Any]) -> dict[str, Any]:
    """A GRPO job's last-window rewards, rollout against TRL (repeat r = seed r on both sides): each
    side's mean, the mean per-seed difference and its 95% interval, and the verdict: yes where
    rollout's mean is >= TRL's, tie where it is below but the interval holds 0, else NO."""
    mean = {n: statistics.fmean(e["reward_last"] for e in extra[n]) for n in ("rollout", "trl")}
    diffs = [a["reward_last"] - b["reward_last"] for a, b in zip(extra["rollout"], extra["trl"], strict=True)]
    low, high = paired_interval(diffs)
    met = "yes" if mean["rollout"] >= mean["trl"] else ("tie" if high >= 0 else "NO")
    return {**mean, "difference": statistics.fmean(diffs), "low": low, "high": high, "met": met}


def render_markdown(rows: list[dict[str, Any]], startup: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    commit = f", {meta['commit']}" if meta.get("commit") else ""
    out = [f"# rollout benchmarks, {meta['date']}, {meta['host']}{commit}", "",
           f"{meta['versions']}; {meta['cpus']} cpus; mode {meta['mode']}; OMP_WAIT_POLICY {meta['omp']}; "
           f"{'' if meta.get('cpu_matmul', 'torch') == 'torch' else 'rollout cpu_matmul ' + meta['cpu_matmul'] + '; '}"
           f"load average {meta['load_before']} before, {meta['load_after']} after; {meta['minutes']:.1f} min.", "",
           *([f"Machine: {summary_line(meta['cpu'], meta['calibration'])}", ""] if "cpu" in meta else []),
           "Figures: min / median / max over the repeats. Ratio: median of the per-repeat ratios "
           "(sides run back to back, order alternating), [min-max] in brackets.", "",
           "| job | threads | unit | rollout | peer | bare | ratio | median ratio [min-max] | target | met | "
           "repeats | load |", "|---|---:|---|---|---|---|---|---|---:|---|---:|---|"]
    for r in rows:
        sides = r["sides"]
        names = list(sides)
        ours = "rollout" if "rollout" in sides else names[0]
        named = [n for n in r["ratio"].split(" ")[0].split("/") if n in sides and n != ours]  # "rollout/no-kv"
        peer = named[0] if named else next((n for n in names if n not in (ours, "bare")), "")
        cell = {n: "/".join(_fmt(sides[n][k]) for k in ("min", "median", "max")) for n in names}
        spread = r["ratio_spread"]
        out.append(
            f"| {r['job']} | {r['threads']} | {r['unit']} | {cell[ours]} | {peer + ' ' if peer else ''}"
            f"{cell.get(peer, '')} | {cell.get('bare', '')} | {r['ratio']} | **{r['median_ratio']:.2f}x** "
            f"[{spread['min']:.2f}-{spread['max']:.2f}] | {'' if r['target'] is None else r['target']} | "
            f"{'' if r['met'] is None else ('yes' if r['met'] else 'NO')} | {r['repeats']} | "
            f"{r['load']['min']:.1f}-{r['load']['max']:.1f} |")
    rewards = [r for r in rows if r["job"] in ("grpo", "grpo-learn") and "trl" in r["extra"]]
    if rewards:
        out += ["", "GRPO's sampled reward, the mean of the first / last steps of each run (window: "
                f"{REWARD_WINDOW} steps, or half the run), repeat r = seed r on both sides. Difference: rollout's "
                "last-window reward minus TRL's, seed by seed, its mean and 95% interval over the seeds "
                "(Student's t). met: yes where rollout's mean is >= TRL's; tie where it is below but the "
                "interval holds 0 (the seeds cannot tell the two apart: the update is the same, "
                "`grpo_trl_parity.py`); NO where the whole interval is below 0.", "",
                "| job | threads | steps | rollout first -> last, per seed | TRL first -> last, per seed | "
                "mean last, rollout / TRL | difference, mean [95%] | met |", "|---|---:|---:|---|---|---|---|---|"]
        for r in rewards:
            per_side = {n: r["extra"][n] for n in ("rollout", "trl")}
            text = {n: ", ".join(f"{e['reward_first']:.3f} -> {e['reward_last']:.3f}" for e in v)
                    for n, v in per_side.items()}
            c = reward_comparison(r["extra"])
            steps = per_side["rollout"][0]["steps"]
            out.append(f"| {r['job']} | {r['threads']} | {steps} | {text['rollout']} | {text['trl']} | "
                       f"{c['rollout']:.3f} / {c['trl']:.3f} | {c['difference']:+.3f} "
                       f"[{c['low']:+.3f}, {c['high']:+.3f}] | {c['met']} |")
    if startup:
        out += ["", "| command | wall min | wall median | wall max | cpu min | cpu median | target | met (median wall) |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for name, v in startup.items():
            w, c = _spread(v["wall"]), _spread(v["cpu"])
            ours = name in ("--help", "validate")
            verdict = ("yes" if w["median"] < STARTUP_TARGET_S else "NO") if ours else ""
            out.append(f"| {'rollout ' + name if ours else name} | {w['min']:.3f} | {w['median']:.3f} | {w['max']:.3f} | "
                       f"{c['min']:.3f} | {c['median']:.3f} | {f'< {STARTUP_TARGET_S} s' if ours else 'reference'} | {verdict} |")
    return "\n".join(out) + "\n"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("rollout", "trl", "transformers", "torch"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found) + f", python {platform.python_version()}"


def git_commit() -> str | None:
    """The checkout's commit (`git describe --always --dirty`), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    started, load_before = time.perf_counter(), os.getloadavg()
    budget = args.budget_min * 60
    results: dict[int, dict[str, Any]] = {t: {} for t in args.threads}
    print("== machine", flush=True)
    machine = run_worker("machine", 1, 0, args)["machine"]
    startup = None
    if "startup" in args.only:
        print("== startup", flush=True)
        startup = run_worker("startup", 1, budget * WEIGHTS["startup"], args)["startup"]
    for threads in args.threads:
        for job in (j for j in args.only if j != "startup"):
            share = budget * WEIGHTS[job] / len(args.threads)
            print(f"== {job}, {threads} thread(s), budget {share / 60:.1f} min", flush=True)
            results[threads].update(run_worker(job, threads, share, args))
    rows = summarize(results)
    now = dt.datetime.now()
    meta = {"date": now.strftime("%Y-%m-%d %H:%M"), "host": socket.gethostname(), "commit": git_commit(),
            "versions": versions(),
            "cpus": os.cpu_count(), "mode": "quick" if args.quick else "full",
            "omp": "PASSIVE" if args.omp_passive else "spin (unset)",
            "cpu_matmul": args.cpu_matmul,
            "load_before": " ".join(f"{x:.2f}" for x in load_before),
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "minutes": (time.perf_counter() - started) / 60, **machine}
    text = render_markdown(rows, startup, meta)
    print("\n" + text)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{args.out}/{now.strftime('%Y-%m-%d')}-{socket.gethostname()}"
        if Path(f"{stem}.md").exists():  # an earlier run of the same day and host stays
            stem += now.strftime("-%H%M")
        Path(f"{stem}.md").write_text(text, encoding="utf-8")
        Path(f"{stem}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "startup": startup, "raw": results}, indent=1), encoding="utf-8")
        print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
