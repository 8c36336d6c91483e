"""Robustness grid: every learning example x seeds x torch thread counts, held-out figures.

    .venv/bin/python benchmarks/learning_grid.py                                  # all, seeds 0-4, threads 1 and 2
    .venv/bin/python benchmarks/learning_grid.py --algos rm,grpo --seeds 0,1 --threads 1
    .venv/bin/python benchmarks/learning_grid.py --jobs 2 --out grid.jsonl        # two cells at once (1-thread cells)

A cell is one (seed, threads) pair. For each cell the examples run as the demo
chains them, with `seed = <seed>` and `[backend] num_threads = <threads>`
appended to each example config (nothing else changes):

    sft-tiny   -> rm-tiny (the RM starts from the SFT model), dpo-tiny, kto-tiny
    sft-warmup -> grpo-tiny, ppo-tiny (RL starts from the partly trained SFT model)
    sft-tiny -> rm-tiny, then sft-warmup -> ppo-rm-tiny (PPO with that RM as its only training reward)

then each trained model is scored on the held-out files of `rollout data
arithmetic` (made once, seed 0, like the demo):

| algo | figure |
|---|---|
| sft  | greedy accuracy on `eval_prompts.jsonl` |
| rm   | pair accuracy on `eval_pref.jsonl` |
| dpo  | implicit-reward pair accuracy on `eval_pref.jsonl` (reference = the SFT model) |
| kto  | log-prob gap desirable - undesirable on `eval_kto.jsonl`, after minus before |
| grpo, ppo, ppo-rm | mean reward of 8 samples (T=1, prompt i seeded `derive_seed(123, i)`) per held-out prompt, after minus the warm-up start |

Each cell runs in its own process (`--cell`), so thread counts and RNG states
never leak between cells. The table prints one row per (algo, seed, threads),
then the worst and the median cell per algorithm. `--out` appends every
figure as a JSON line (rerun with `--report grid.jsonl` to print the table
again without training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("sft", "rm", "dpo", "kto", "grpo", "ppo", "ppo-rm")
FIGURE = {
    "sft": "held-out greedy accuracy",
    "rm": "held-out pair accuracy",
    "dpo": "held-out implicit-reward accuracy",
    "kto": "held-out desirable gap, gain",
    "grpo": "held-out mean reward, gain",
    "ppo": "held-out mean reward, gain",
    "ppo-rm": "held-out mean reward (the checker's), gain; trained on the RM only",
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def example_config(name: str, workspace: Path, dest: Path, *, seed: int, threads: int) -> Path:
    """The example with `../local/` in `workspace`, outputs in `dest`, and the cell's seed and threads."""
    text = (ROOT / "examples" / name).read_text()
    assert "\nseed = 0\n" in text, name
    text = text.replace("\nseed = 0\n", f"\nseed = {seed}\n")
    text = text.replace('"../local/rollout.db"', f'"{dest}/rollout.db"')
    text = text.replace('"../local/object-store"', f'"{dest}/object-store"')
    for model in ("sft-tiny", "sft-warmup", "rm-tiny", "dpo-tiny", "kto-tiny", "grpo-tiny", "ppo-tiny", "ppo-rm-tiny"):
        text = text.replace(f'"../local/models/{model}"', f'"{dest}/models/{model}"')
    text = text.replace('"../local/', f'"{workspace}/')
    text += f"\n[backend]\nnum_threads = {threads}\n"
    path = dest / name
    path.write_text(text)
    return path


def sampled_reward(model_dir: Path, rows: list[dict]) -> float:
    """Mean reward of 8 samples (T=1) a held-out prompt; prompt i seeded `derive_seed(123, i)`, as the
    tests' `held_out_rewards` (one seed for all prompts would reuse 8 random streams prompt after prompt)."""
    from rollout.inference.hf_engine import load_hf_engine
    from rollout.inference.types import GenerationRequest, SamplingParams, derive_seed
    from rollout.tasks.arithmetic import is_correct

    engine = load_hf_engine(str(model_dir))
    out = engine.generate([
        GenerationRequest(prompt=r["prompt"],
                          params=SamplingParams(temperature=1.0, max_tokens=6, n=8, seed=derive_seed(123, i)))
        for i, r in enumerate(rows)])  # fmt: skip
    hits = sum(is_correct(x.text, r["answer"]) for c, r in zip(out, rows, strict=True) for x in c)
    return hits / (8 * len(rows))


def run_cell(workspace: Path, dest: Path, *, seed: int, threads: int, algos: list[str]) -> list[dict]:
    """Train and score the selected examples for one (seed, threads) cell, in this process."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    from rollout.algorithms.dpo import implicit_reward_accuracy, train_dpo
    from rollout.algorithms.grpo import train_grpo
    from rollout.algorithms.kto import desirable_gap, train_kto
    from rollout.algorithms.ppo import train_ppo
    from rollout.algorithms.rm import pair_accuracy, train_rm
    from rollout.algorithms.sft import train_sft
    from rollout.config import load_config
    from rollout.tasks.arithmetic import greedy_accuracy

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    data = workspace / "data" / "arithmetic"
    models = dest / "models"
    out: list[dict] = []

    def record(algo: str, value: float, seconds: float, **extra: float) -> None:
        row = {"algo": algo, "seed": seed, "threads": threads, "value": round(value, 4),
               "train_s": round(seconds, 1), **{k: round(v, 4) for k, v in extra.items()}}
        out.append(row)
        print(json.dumps(row), flush=True)

    def train(name: str, fn) -> float:
        t0 = time.perf_counter()
        fn(load_config(example_config(name, workspace, dest, seed=seed, threads=threads)))
        return time.perf_counter() - t0

    def causal(path: Path):
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)

    if "sft" in algos or ({"rm", "dpo", "kto", "ppo-rm"} & set(algos) and not (models / "sft-tiny").exists()):
        seconds = train("sft-tiny.toml", train_sft)
        if "sft" in algos:
            record("sft", greedy_accuracy(*causal(models / "sft-tiny"), _rows(data / "eval_prompts.jsonl")), seconds)
    if "rm" in algos or ("ppo-rm" in algos and not (models / "rm-tiny").exists()):
        seconds = train("rm-tiny.toml", train_rm)
        rm = AutoModelForSequenceClassification.from_pretrained(models / "rm-tiny")
        acc = pair_accuracy(rm, AutoTokenizer.from_pretrained(models / "rm-tiny"), _rows(data / "eval_pref.jsonl"),
                            max_seq_len=64)
        record("rm", acc, seconds)  # also when trained only as ppo-rm's reward: the RM it trained against
    if "dpo" in algos:
        seconds = train("dpo-tiny.toml", train_dpo)
        reference, tok = causal(models / "sft-tiny")
        acc, margin = implicit_reward_accuracy(
            AutoModelForCausalLM.from_pretrained(models / "dpo-tiny"), reference, tok,
            _rows(data / "eval_pref.jsonl"), beta=0.1, max_seq_len=64)
        record("dpo", acc, seconds, margin=margin)
    if "kto" in algos:
        seconds = train("kto-tiny.toml", train_kto)
        lines = _rows(data / "eval_kto.jsonl")
        before = desirable_gap(*causal(models / "sft-tiny"), lines, max_seq_len=64)
        after = desirable_gap(AutoModelForCausalLM.from_pretrained(models / "kto-tiny"),
                              AutoTokenizer.from_pretrained(models / "sft-tiny"), lines, max_seq_len=64)
        record("kto", after - before, seconds, before=before, after=after)
    if {"grpo", "ppo", "ppo-rm"} & set(algos):
        prompts = _rows(data / "eval_prompts.jsonl")
        warm_s = 0.0 if (models / "sft-warmup").exists() else train("sft-warmup.toml", train_sft)
        start = sampled_reward(models / "sft-warmup", prompts)
        for algo, name, fn in (("grpo", "grpo-tiny.toml", train_grpo), ("ppo", "ppo-tiny.toml", train_ppo),
                               ("ppo-rm", "ppo-rm-tiny.toml", train_ppo)):
            if algo in algos:
                seconds = train(name, fn)
                after = sampled_reward(models / f"{algo}-tiny", prompts)
                record(algo, after - start, seconds, before=start, after=after, warmup_s=warm_s)
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'algo':<6} {'seed':>4} {'thr':>3} {'figure':>8}  {'train s':>7}  detail")
    for row in sorted(rows, key=lambda r: (ALGOS.index(r["algo"]), r["seed"], r["threads"])):
        detail = " ".join(f"{k}={row[k]}" for k in ("before", "after", "margin") if k in row)
        print(f"{row['algo']:<6} {row['seed']:>4} {row['threads']:>3} {row['value']:>8.3f}  {row['train_s']:>7.1f}  {detail}")
    print(f"\n{'algo':<6} {'cells':>5} {'worst':>7} {'median':>7} {'best':>7}  figure")
    for algo in ALGOS:
        values = [r["value"] for r in rows if r["algo"] == algo]
        if values:
            print(f"{algo:<6} {len(values):>5} {min(values):>7.3f} {statistics.median(values):>7.3f}"
                  f" {max(values):>7.3f}  {FIGURE[algo]}")


def _ints(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default=",".join(ALGOS))
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once (each cell gets its thread count)")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="append each figure as a JSON line")
    parser.add_argument("--report", type=Path, default=None, help="print the table of a previous --out file")
    parser.add_argument("--cell", nargs=2, type=int, metavar=("SEED", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    algos = [a for a in args.algos.split(",") if a]
    unknown = sorted(set(algos) - set(ALGOS))
    if unknown:
        parser.error(f"unknown algos {unknown}; expected some of {','.join(ALGOS)}")
    if args.report:
        print_table(_rows(args.report))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rollout-grid-"))
    workspace = work / "local"
    if args.cell:
        seed, threads = args.cell
        dest = work / f"seed{seed}-t{threads}"
        dest.mkdir(parents=True, exist_ok=True)
        run_cell(workspace, dest, seed=seed, threads=threads, algos=algos)
        return

    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    if not (workspace / "models" / "tiny").exists():
        init_tiny_model(workspace / "models" / "tiny")
        write_arithmetic_dataset(workspace / "data" / "arithmetic")
    cells = [(s, t) for t in _ints(args.threads) for s in _ints(args.seeds)]
    # Idle OpenMP threads sleep instead of spinning: on a busy machine a spinning 2-thread cell
    # crawls. The wait policy changes no result (same threads, same work split), only the waiting.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    rows: list[dict] = []
    pending = list(cells)
    running: list[tuple[subprocess.Popen, tuple[int, int]]] = []
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < args.jobs:
            seed, threads = pending.pop(0)
            cmd = [sys.executable, __file__, "--cell", str(seed), str(threads), "--algos", ",".join(algos),
                   "--workdir", str(work)]
            log = open(work / f"seed{seed}-t{threads}.log", "w")  # noqa: SIM115 - the child owns it
            running.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env),
                            (seed, threads)))
        proc, cell = running.pop(0)
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"cell seed={cell[0]} threads={cell[1]} failed (exit {proc.returncode}):"
                  f" see {work}/seed{cell[0]}-t{cell[1]}.log", file=sys.stderr)
        for line in stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                rows.append(row)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
    print_table(rows)
    print(f"\n{len(cells)} cells in {time.perf_counter() - t0:.0f} s; work folder {work}")


if __name__ == "__main__":
    main()
