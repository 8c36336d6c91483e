"""GRPO and PPO seconds per step: this tree against an earlier commit, interleaved (did a change slow a step?).

    .venv/bin/python benchmarks/rl_step_compare.py                          # vs a2c223d~1 (before the episode loop)
    .venv/bin/python benchmarks/rl_step_compare.py --base HEAD~3 --algos grpo --repeats 3 --steps 30

The base commit's `src/` is unpacked into a temp folder (`git archive`); every run is
a fresh interpreter with `PYTHONPATH` set to one tree's `src/`, so both trees train
with the same installed packages. Both sides run the *base* commit's example config
(`examples/<algo>-tiny.toml`: single-turn, arithmetic reward; a newer tree reads
older configs), with the tiny untrained model (`init_tiny_model`), the arithmetic
data, `--steps` optimizer steps, no snapshot before the end, one torch thread
(`--threads`). The timed figure is the median process CPU time (every thread:
the sampler's worker thread too) between consecutive steps' metric records (the
training loop hands them to its recorder once per step), steps 6..N: model
loading, the first steps and the export are outside it. CPU time rather than
wall time: on a machine other jobs keep busy, wall time also counts the waits
for a core, which made pair ratios swing 0.88..1.51 in a trial run.
Runs alternate base / head / head / base ..., `--repeats` times per algorithm;
the report gives each side's median s/step over repeats and the median of the
per-pair ratios head / base (above 1: this tree is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 5  # steps before the timed window

CHILD = """
import json, sys, time
import rollout
print("TREE " + rollout.__file__)
from rollout import observe
from rollout.config import load_config
stamps = []
original = observe.RunRecorder.metrics
def metrics(self, step, values):
    stamps.append(time.process_time())
    return original(self, step, values)
observe.RunRecorder.metrics = metrics
import importlib
algo = sys.argv[2]
train = getattr(importlib.import_module(f"rollout.algorithms.{algo}"), f"train_{algo}")
train(load_config(sys.argv[1]))
print("STEPS " + json.dumps([b - a for a, b in zip(stamps, stamps[1:])]))
"""


def _config(base: str, algo: str, work: Path, steps: int, side: str) -> Path:
    """The base commit's example, on the workspace's model and data, its store and export in a folder
    of its own per side (the trees' store schemas may differ)."""
    text = subprocess.run(["git", "show", f"{base}:examples/{algo}-tiny.toml"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    text = text.replace('"../local/models/sft-warmup"', f'"{work}/models/tiny"')
    text = text.replace('"../local/data/', f'"{work}/data/').replace('"../local/', f'"{work}/run-{algo}-{side}/')
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if key == "max_steps":
            line = f"max_steps = {steps}"
        elif key == "every_steps":
            line = f"every_steps = {steps + 1000}"
        lines.append(line)
    path = work / f"{algo}-{side}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tree: Path, config: Path, algo: str, threads: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(config), algo], env=env, capture_output=True, text=True,
                         cwd=config.parent)
    if out.returncode:
        sys.exit(f"{algo} run on {tree} failed:\n{out.stderr[-3000:]}")
    imported = next(x for x in out.stdout.splitlines() if x.startswith("TREE ")).removeprefix("TREE ")
    if not Path(imported).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"the child imported rollout from {imported}, not from {tree}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("STEPS "))
    return json.loads(line.removeprefix("STEPS "))[SKIP - 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="a2c223d~1", help="commit to compare with (default: before the episode loop)")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="rl-step-compare-") as tmp:
        work = Path(tmp)
        old = work / "base"
        old.mkdir()
        archive = subprocess.run(["git", "archive", base, "src"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        sys.path.insert(0, str(ROOT / "src"))
        from rollout.models.tiny import init_tiny_model
        from rollout.tasks.arithmetic import write_arithmetic_dataset

        init_tiny_model(work / "models" / "tiny")
        write_arithmetic_dataset(work / "data" / "arithmetic")
        print(f"base {base} vs head {head}{' + uncommitted src changes' if dirty else ''}; {args.steps} steps,"
              f" timed steps {SKIP + 1}..{args.steps}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
        print("| algo | base CPU s/step | head CPU s/step | head / base (median of pairs) | pair ratios |")
        print("|---|---:|---:|---:|---|")
        for algo in args.algos.split(","):
            configs = {side: _config(base, algo, work, args.steps, side) for side in ("base", "head")}
            sides: dict[str, list[float]] = {"base": [], "head": []}
            ratios = []
            for r in range(args.repeats):
                order = [("base", old), ("head", ROOT)] if r % 2 == 0 else [("head", ROOT), ("base", old)]
                pair = {}
                for name, tree in order:
                    pair[name] = statistics.median(_run(tree, configs[name], algo, args.threads))
                    sides[name].append(pair[name])
                ratios.append(pair["head"] / pair["base"])
            print(f"| {algo} | {statistics.median(sides['base']):.4f} | {statistics.median(sides['head']):.4f} |"
                  f" {statistics.median(ratios):.3f} | {' '.join(f'{x:.3f}' for x in ratios)} |", flush=True)
        print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
