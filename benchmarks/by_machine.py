"""Where issue 14's targets stand on each kind of machine: `make bench`'s results, grouped by kind.

    .venv/bin/python benchmarks/by_machine.py                      # each kind's latest whole run
    .venv/bin/python benchmarks/by_machine.py --since 2026-12-04   # and, per target, how many runs since met it

Reads `benchmarks/results/*.json` (`run_all.py` writes one per run). A run's kind is the machine
line `machine.py` put in it (since 2026-12-01; older runs have none and are left out): the CPU's
model name and its widest vector ISA (AMX, AVX-512 or AVX2), which is what the ratios turn on. A
whole run has every targeted ratio at 1 and 2 threads and the startup table (an `--only` subset is
not one). Per kind, the first table shows the latest whole run's median ratios, 1 / 2 threads,
each as `run_all.py` judged it (`*` short of the target); `--since` adds a second table: of the
kind's whole runs since that date, how many met each target, 1 / 2 threads. Runs of different
commits are compared: each column names its run (and its commit where the run recorded one).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from run_all import STARTUP_TARGET_S, TARGETS, reward_comparison

HERE = Path(__file__).resolve().parent
THREADS = (1, 2)
STARTUP = ("--help", "validate")


def machine_kind(meta: dict[str, Any]) -> str | None:
    """'AMD EPYC, AVX-512' and the like, from a run's machine line; None for a run without one."""
    cpu = meta.get("cpu")
    if not cpu:
        return None
    name = " ".join(cpu.get("model", "unknown CPU").replace("(R)", "").replace("(TM)", "").split())
    name = name.removesuffix(" Processor").removesuffix(" CPU")
    isa = cpu.get("isa", [])
    widest = "AMX" if "amx_tile" in isa else "AVX-512" if "avx512f" in isa else "AVX2" if "avx2" in isa else "no AVX2"
    return f"{name}, {widest}"


def verdicts(run: dict[str, Any]) -> dict[tuple[str, int], tuple[str, bool]] | None:
    """{(target name, threads): (the figure as text, met)} for a whole run, None for a partial one."""
    rows = {(r["job"], r["ratio"], r["threads"]): r for r in run.get("rows", [])}
    startup = run.get("startup") or {}
    if any((job, ratio, t) not in rows for job, ratio in TARGETS for t in THREADS) or any(
            name not in startup for name in STARTUP):
        return None
    out: dict[tuple[str, int], tuple[str, bool]] = {}
    for (job, ratio), target in TARGETS.items():
        for t in THREADS:
            median = rows[job, ratio, t]["median_ratio"]
            out[f"{job} {ratio} >= {target}", t] = (f"{median:.2f}x", median >= target)
    for t in THREADS:
        extra = rows["grpo-learn", "trl/rollout (s/step)", t].get("extra", {})
        if "rollout" in extra and "trl" in extra:
            c = reward_comparison(extra)
            out["grpo-learn reward, rollout >= TRL (or a tie)", t] = (
                f"{c['met']} ({c['rollout']:.3f} vs {c['trl']:.3f})", c["met"] != "NO")
    for name in STARTUP:
        median = statistics.median(startup[name]["wall"])
        out[f"rollout {name} < {STARTUP_TARGET_S} s (median wall)", 1] = (f"{median:.3f} s", median < STARTUP_TARGET_S)
    return out


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """Every results file with a machine line, oldest first: {file, date, commit, kind, verdicts}."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            run = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise SystemExit(f"{path}: not a results file: {err}") from None
        meta = run.get("meta", {})
        kind = machine_kind(meta)
        if kind is None:
            continue
        runs.append({"file": path.name, "date": meta.get("date", ""), "commit": meta.get("commit"), "kind": kind,
                     "verdicts": verdicts(run)})
    runs.sort(key=lambda r: r["date"])
    return runs


def _cell(pairs: list[tuple[str, bool]]) -> str:
    return " / ".join(text if met else f"{text}*" for text, met in pairs)


def render(runs: list[dict[str, Any]], since: str | None = None) -> str:
    whole = [r for r in runs if r["verdicts"] is not None]
    kinds = sorted({r["kind"] for r in whole})
    if not kinds:
        return "no whole run with a machine line\n"
    latest = {k: [r for r in whole if r["kind"] == k][-1] for k in kinds}
    names = list(dict.fromkeys(name for r in latest.values() for name, _ in r["verdicts"]))
    head = [f"{k}: {r['file']}" + (f" ({r['commit']})" if r["commit"] else "") for k, r in latest.items()]
    out = ["Latest whole run of each kind, 1 / 2 threads (`*`: short of the target):", "",
           "| target | " + " | ".join(head) + " |", "|---|" + "---|" * len(kinds)]
    for name in names:
        cells = [_cell([r["verdicts"][name, t] for t in THREADS if (name, t) in r["verdicts"]]) or "-"
                 for r in latest.values()]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if since:
        recent = [r for r in whole if r["date"] >= since]
        count: dict[tuple[str, str, int], list[bool]] = defaultdict(list)
        for r in recent:
            for (name, t), (_, met) in r["verdicts"].items():
                count[r["kind"], name, t].append(met)
        runs_of = {k: sum(r["kind"] == k for r in recent) for k in kinds}
        out += ["", f"Whole runs since {since} that met each target, 1 / 2 threads:", "",
                "| target | " + " | ".join(f"{k} ({runs_of[k]} run{'s' if runs_of[k] != 1 else ''})" for k in kinds) + " |",
                "|---|" + "---|" * len(kinds)]
        for name in names:
            cells = [" / ".join(f"{sum(count[k, name, t])}/{len(count[k, name, t])}" for t in THREADS
                                if count[k, name, t]) or "-" for k in kinds]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder of run_all.py's .json files")
    parser.add_argument("--since", help="also count, per target, the whole runs since this date (YYYY-MM-DD)")
    args = parser.parse_args(argv)
    print(render(load_runs(args.results), args.since), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
