"""`rollout plan`'s memory estimate against the peak RSS of the real run it planned.

    .venv/bin/python benchmarks/plan_memory.py                        # SFT, DPO, GRPO on tiny + 52M, ~15 min on 2 cores
    .venv/bin/python benchmarks/plan_memory.py --models tiny --algos sft   # a quick look
    .venv/bin/python benchmarks/plan_memory.py --calibrate            # also print the runtime constants to use

For each (model, case) it writes a short run config, runs `rollout plan -o plan.lock`, reads the
estimate from the lock, then runs `rollout run --plan plan.lock` as a child process and takes its
peak RSS from `os.wait4` (the kernel's `ru_maxrss` of that process). Linux carries the parent's
peak into a child's `ru_maxrss` (the mm the child had before its `exec` is the parent's), so this
parent never imports torch: the models and data are made by a child of their own, and the script
refuses to measure if its own peak RSS is over 100 MiB. Models: the 1.05M
`init-tiny` default and a 52M one (`init-tiny --hidden-size 512 --num-layers 12 --num-heads 8
--num-kv-heads 4 --intermediate-size 2304`), both made once under --work. Cases: `sft` (arithmetic
chats, 32 rows), `sft-long` (4 rows of 512 tokens: the activation term), `dpo` (16 pairs, a frozen
reference copy), `grpo` (8 prompts x 8 completions of 8 tokens: the generation engine's copy and
its KV cache). One torch thread; every run ends with a train_state snapshot.

`--calibrate` prints, per algorithm, measured peak minus the model-dependent parts of the tiny
runs' estimates: the `RUNTIME_BYTES` of `rollout.plan_memory`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROLLOUT = Path(sys.executable).parent / "rollout"
MiB = 2**20
MODELS = {
    "tiny": {},
    "52m": {"hidden_size": 512, "num_layers": 12, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 2304},
}
CASES = {
    "sft": ("sft", "sft.jsonl", {"minibatch_size": 32, "packing": {"kind": "off", "max_seq_len": 64},
                                 "loss_on": {"kind": "assistant"}, "budget": {"max_steps": 3}}),
    "sft-long": ("sft", "long.jsonl", {"minibatch_size": 4, "packing": {"kind": "off", "max_seq_len": 512},
                                       "budget": {"max_steps": 1}}),
    "dpo": ("dpo", "pref.jsonl", {"minibatch_size": 16, "packing": {"kind": "off", "max_seq_len": 64},
                                  "budget": {"max_steps": 2}}),
    "grpo": ("grpo", "prompts.jsonl", {"minibatch_size": 8, "num_generations": 8, "max_tokens": 8,
                                       "packing": {"kind": "off", "max_seq_len": 64}, "budget": {"max_steps": 2},
                                       "rewards": [{"name": "arithmetic_correct"}]}),
}
ALGO_OF_CASE = {"sft": "sft", "sft-long": "sft", "dpo": "dpo", "grpo": "grpo"}


def make_inputs(work: Path, models: list[str]) -> dict[str, Path]:
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    data = work / "data"
    if not (data / "sft.jsonl").is_file():
        write_arithmetic_dataset(data, num_train=512, num_eval=8)
    long_lines = data / "long.jsonl"
    if not long_lines.is_file():
        rng = random.Random(0)
        words = ["the", "cat", "sat", "on", "a", "mat", "while", "numbers", "grow", "quickly", "under", "bright", "lights", "and", "rivers", "flow"]
        long_lines.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=700))}) + "\n"
                                      for _ in range(16)))
    dirs = {}
    for name in models:
        path = work / "models" / name
        if not (path / "config.json").is_file():
            init_tiny_model(path, force=True, **MODELS[name])
        dirs[name] = path
    return dirs


def write_config(path: Path, algo: str, model: Path, dataset: Path, block: dict) -> None:
    lines = ["schema_version = 1", "seed = 0", "[storage.embedded]", f'path = "{path.parent}/store/rollout.db"',
             "[storage.objects]", f'path = "{path.parent}/store/objects"', "[algorithm]", f'kind = "{algo}"',
             f"[algorithm.{algo}]"]
    tables = {k: v for k, v in block.items() if isinstance(v, dict)}
    arrays = {k: v for k, v in block.items() if isinstance(v, list)}
    lines += [f"{k} = {json.dumps(v)}" for k, v in block.items() if k not in tables and k not in arrays]
    tables |= {"base_model": {"uri": str(model)}, "optimizer": {"kind": "adamw", "lr": 1e-4},
               "dataset": {"path": str(dataset)}}
    for key, table in tables.items():
        lines.append(f"[algorithm.{algo}.{key}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    for key, entries in arrays.items():
        for entry in entries:
            lines.append(f"[[algorithm.{algo}.{key}]]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    lines += ["[backend]", 'device = "cpu"', "num_threads = 1"]
    path.write_text("\n".join(lines) + "\n")


def peak_rss(args: list[str]) -> tuple[int, float, str]:
    """(peak RSS bytes, seconds, stderr tail) of one child process."""
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert child.stderr is not None
    err = child.stderr.read().decode(errors="replace")  # drained before wait4: a full pipe would block it
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{err[-2000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - started, err[-300:]


def measure(work: Path, model_name: str, model: Path, case: str) -> dict:
    algo, data_file, block = CASES[case]
    folder = work / "runs" / f"{model_name}-{case}"
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.toml"
    write_config(config, algo, model, work / "data" / data_file, block)
    lock = folder / "plan.lock"
    plan = subprocess.run([str(ROLLOUT), "plan", "--config", str(config), "-o", str(lock)],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if plan.returncode != 0:
        raise SystemExit(f"plan of {config} failed:\n{plan.stderr}")
    estimate = json.loads(lock.read_text())["estimate"]
    measured, seconds, _ = peak_rss([str(ROLLOUT), "run", "--plan", str(lock)])
    return {"model": model_name, "case": case, "estimate": estimate["total_bytes"], "measured": measured,
            "phase": estimate["peak_phase"], "parts": estimate["parts"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/rollout-plan-memory"))
    parser.add_argument("--models", default="tiny,52m")
    parser.add_argument("--algos", default="sft,sft-long,dpo,grpo", help="cases: sft, sft-long, dpo, grpo")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--make-inputs-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_inputs_only:
        make_inputs(args.work, args.models.split(","))
        return
    subprocess.run([sys.executable, __file__, "--make-inputs-only", "--work", str(args.work), "--models", args.models],
                   check=True)
    models = {name: args.work / "models" / name for name in args.models.split(",")}
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if own_peak > 100 * MiB:  # it would be every child's floor
        raise SystemExit(f"this process peaked at {own_peak / MiB:.0f} MiB: its children's ru_maxrss would be wrong")
    print(f"{'model':6} {'case':9} {'estimate':>10} {'measured':>10} {'error':>7}  peak phase   (run s)")
    rows = []
    for model_name, model in models.items():
        for case in args.algos.split(","):
            row = measure(args.work, model_name, model, case)
            rows.append(row)
            error = row["estimate"] / row["measured"] - 1
            print(f"{model_name:6} {case:9} {row['estimate'] / MiB:8.0f}Mi {row['measured'] / MiB:8.0f}Mi"
                  f" {error:+7.1%}  {row['phase']:12} ({row['seconds']:.0f})", flush=True)
    worst = max(abs(r["estimate"] / r["measured"] - 1) for r in rows)
    print(f"worst error {worst:.1%}")
    if args.calibrate:
        for row in rows:
            if row["model"] == "tiny":
                model_part = row["estimate"] - row["parts"]["runtime"]
                print(f'runtime {ALGO_OF_CASE[row["case"]]} ({row["case"]}): '
                      f"{(row['measured'] - model_part) / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
