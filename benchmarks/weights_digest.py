"""Digest of the final weights of every example config, trained briefly at a fixed seed.

    PYTHONPATH=src python benchmarks/weights_digest.py                      # prints JSON
    PYTHONPATH=src python benchmarks/weights_digest.py > benchmarks/weights_digest.baseline.json
    PYTHONPATH=src python benchmarks/weights_digest.py --check benchmarks/weights_digest.baseline.json
    PYTHONPATH=src python benchmarks/weights_digest.py --threads 2 > /tmp/a.json  # then again with
    PYTHONPATH=src python benchmarks/weights_digest.py --threads 2 --check /tmp/a.json   # same bits at 2?

A refactor that claims "behaviour unchanged" must leave these digests
byte-identical. The digests hold for one machine: CPU kernels differ in the
last bits between CPUs (the baseline here was written on a 2-core AMD EPYC VM with AVX-512 on
2026-11-28 18:59, when sampling became inverse CDF (`inference/sampling.py`), which moved the four
RL digests -- grpo-tiny, ppo-tiny and the two grpo variants -- and no other: on that VM the commit
before gave the same six others. The baseline before was an Intel Xeon VM's, where none of this
VM's digests match. On another machine, run the script on the commit
before a change first and compare with that). The script makes the tiny model and the arithmetic data in a
temporary folder, then runs each example config from `examples/` through the
real CLI (`rollout train <kind>`, one subprocess each) with its paths rewritten
into that folder (as `tests/integration/conftest.py:example_config` does),
`budget.max_steps` cut short, `snapshot.every_steps` set to half of it (so the
mid-run snapshot path runs too) and `[backend] num_threads = 1` (CPU
determinism; `--threads N` for another count: two runs at one count must match each other, and the
baseline is the 1-thread one. On the AVX-512 AMD VM, 2026-11-28, two `--threads 2` runs matched each
other and, these runs being short and small, the 1-thread baseline too; the 250-step demo GRPO at 2
threads does not match its 1-thread run, but matches itself, three runs out of three). The chain follows the demo: sft -> dpo / kto from the SFT export;
rm from the SFT export when `examples/rm-tiny.toml` starts from
`../local/models/sft-tiny`, else from the untrained tiny model; sft-warmup ->
grpo / ppo, plus three variants (see `RUNS`). It prints `{"<example>": "sha256:<hex of model.safetensors>"}`;
`--check FILE` compares with a saved output and exits 1 on any mismatch.
CPU only (`CUDA_VISIBLE_DEVICES` is cleared); a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    name: str
    example: str
    kind: str
    max_steps: int
    edits: tuple[tuple[str, str], ...] = ()  # (old, new) text replacements before the path rewrite


# Order = dependency order. The `+` variants run paths the examples leave out: the GRPO
# reference model with pipelined generation and two iterations per batch, the LoRA
# adapter as GRPO's reference, and DPO's precomputed reference table under LoRA. (PPO
# under LoRA is left out: it fails today, its weight push keeps peft's parameter names.)
LORA = "\n[algorithm.{kind}.lora]\nr = 4\nalpha = 8.0\n"
RUNS: tuple[Run, ...] = (
    Run("sft-tiny", "sft-tiny", "sft", 12),
    Run("sft-warmup", "sft-warmup", "sft", 12),
    Run("rm-tiny", "rm-tiny", "rm", 12),
    Run("dpo-tiny", "dpo-tiny", "dpo", 12),
    Run("kto-tiny", "kto-tiny", "kto", 12),
    Run("grpo-tiny", "grpo-tiny", "grpo", 6),
    Run("ppo-tiny", "ppo-tiny", "ppo", 6),
    Run("grpo-tiny+ref+pipelined", "grpo-tiny", "grpo", 6, (
        ("beta = 0.0", "beta = 0.04"), ("off_policy_steps = 0", "off_policy_steps = 1"),
        ("num_iterations = 1", "num_iterations = 2"),
        ('"../local/models/grpo-tiny"', '"../local/models/grpo-tiny+ref+pipelined"'),
    )),
    Run("grpo-tiny+lora+ref", "grpo-tiny", "grpo", 6, (
        ("beta = 0.0", "beta = 0.04"),
        ('"../local/models/grpo-tiny"', '"../local/models/grpo-tiny+lora+ref"'),
        ("\n[distributed]", LORA.format(kind="grpo") + "\n[distributed]"),
    )),
    Run("dpo-tiny+lora+precompute", "dpo-tiny", "dpo", 12, (
        ('"../local/models/dpo-tiny"', '"../local/models/dpo-tiny+lora+precompute"'),
        ("precompute = false", "precompute = true"),
        ("\n[distributed]", LORA.format(kind="dpo") + "\n[distributed]"),
    )),
)


def rewrite_config(text: str, *, workspace: Path, dest: Path, exports: Path, max_steps: int, threads: int = 1) -> str:
    """The example's TOML with its store in `dest`, model exports in `exports`, data and the
    tiny model in `workspace`, a short budget and `threads` CPU threads."""
    text = text.replace('"../local/rollout.db"', f'"{dest}/rollout.db"')
    text = text.replace('"../local/object-store"', f'"{dest}/object-store"')
    text = re.sub(r'"\.\./local/models/([\w+-]+)"', lambda m: f'"{exports}/{m.group(1)}"'
                  if m.group(1) != "tiny" else m.group(0), text)
    text = text.replace('"../local/', f'"{workspace}/')
    text, n = re.subn(r"(?m)^max_steps = \d+", f"max_steps = {max_steps}", text)
    assert n == 1, "expected one budget.max_steps"
    text = re.sub(r"(?m)^every_steps = \d+", f"every_steps = {max(1, max_steps // 2)}", text)
    if re.search(r"(?m)^\[backend\]", text):
        text = re.sub(r"(?m)^\[backend\]\n", f"[backend]\nnum_threads = {threads}\n", text)
    else:
        text += f"\n[backend]\nnum_threads = {threads}\n"
    return text


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def run_all(root: Path, only: set[str] | None, threads: int = 1) -> dict[str, str]:
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    workspace, exports = root / "local", root / "exports"
    init_tiny_model(workspace / "models" / "tiny")
    write_arithmetic_dataset(workspace / "data" / "arithmetic")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    digests: dict[str, str] = {}
    for run in RUNS:
        name, kind = run.name, run.kind
        if only is not None and name not in only:
            continue
        dest = root / "runs" / name
        dest.mkdir(parents=True)
        text = (ROOT / "examples" / f"{run.example}.toml").read_text()
        for old, new in run.edits:
            assert old in text, f"{old!r} not in {run.example}"
            text = text.replace(old, new)
        text = rewrite_config(text, workspace=workspace, dest=dest, exports=exports, max_steps=run.max_steps,
                              threads=threads)
        config = dest / f"{name}.toml"
        config.write_text(text)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "rollout.cli.main", "train", kind, "--config", str(config)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"{name}: rollout train {kind} failed (exit {proc.returncode})")
        export = re.search(r'(?m)^dir = "([^"]+)"', text)
        assert export is not None, f"{name} has no [export] dir"
        digests[name] = file_digest(Path(export.group(1)) / "model.safetensors")
        print(f"{name}: {digests[name]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return digests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, help="Compare with this saved output; exit 1 on any mismatch.")
    parser.add_argument("--only", help="Comma-separated example names (dependencies are yours to include).")
    parser.add_argument("--keep", type=Path, help="Work in this (new) folder and keep it, instead of a temp folder.")
    parser.add_argument("--threads", type=int, default=1, help="[backend] num_threads of every run (default 1).")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        digests = run_all(args.keep.resolve(), only, args.threads)
    else:
        with tempfile.TemporaryDirectory(prefix="weights-digest-") as tmp:
            digests = run_all(Path(tmp), only, args.threads)
    print(json.dumps(digests, indent=2))
    if args.check is None:
        return 0
    expected = json.loads(args.check.read_text())
    bad = [n for n in digests if expected.get(n) != digests[n]]
    for n in bad:
        print(f"MISMATCH {n}: expected {expected.get(n)} got {digests[n]}", file=sys.stderr)
    print(f"check: {len(digests) - len(bad)}/{len(digests)} identical to {args.check}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
