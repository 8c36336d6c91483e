"""How long `rollout --help` and `rollout validate` take to start (target: under 0.3 s each).

    .venv/bin/python benchmarks/startup.py                  # 15 runs of each command, ~1 min on 2 busy cores
    .venv/bin/python benchmarks/startup.py --runs 40        # steadier minimums
    .venv/bin/python benchmarks/startup.py --importtime 12  # also: the 12 costliest imports of each command
    .venv/bin/python benchmarks/startup.py --config examples/grpo-tiny.toml   # validate another config

Every command runs in a fresh interpreter, the way a user runs it (the venv's `rollout`
script), with the commands interleaved round by round so a change in the machine's load
hits all of them alike; one untimed round first warms the file cache and the .pyc files
(kept in a private folder, `PYTHONPYCACHEPREFIX`, even where PYTHONDONTWRITEBYTECODE is
set: an installed rollout has its .pyc files). For each: min and median wall time, and min
and median CPU time (user + system of that child alone, from `getrusage`). On a shared
machine the CPU time is the steadier figure: wall time also counts the time the process
waited for a core. Floors: `python -c pass` (the interpreter), `python -c "import typer"`
(the CLI framework every command needs) and the `--help` of a bare typer app with as many
commands as rollout (typer and rich drawing a help screen).

`validate` checks examples/sft-tiny.toml when `make demo` has made its model and data,
else a copy of it pointing at a tiny model and arithmetic data made once in a temp folder
(`rollout model init-tiny`, `rollout data arithmetic`; a few seconds). `validate` scans the
dataset's 4000 lines too; `validate --no-data` shows the cost without that scan.

`--importtime N` runs each command once under `python -X importtime` and prints the N
modules with the largest self time (what loading that module alone cost), and the sum.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sft-tiny.toml"
ROLLOUT = Path(sys.executable).parent / "rollout"
TARGET_S = 0.3
COMMANDS = "validate schema plan run serve dashboard train model data snapshot runs logs infer eval plugins"
TYPER_APP = f"""
import typer
app = typer.Typer(help="A bare typer app.", no_args_is_help=True, add_completion=False)
for name in {COMMANDS.split()!r}:
    app.command(name, help=f"The {{name}} command.")(lambda: None)
app(["--help"], standalone_mode=False)
"""


def rollout_command(*args: str) -> list[str]:
    """The installed console script, else `python -m rollout.cli.main` (same imports, plus runpy)."""
    if ROLLOUT.exists():
        return [str(ROLLOUT), *args]
    return [sys.executable, "-m", "rollout.cli.main", *args]


def prepare_config(work: Path) -> Path:
    """examples/sft-tiny.toml if its model and data exist, else a copy whose `../local/` paths
    point at a tiny model and arithmetic data made under `work`."""
    text = EXAMPLE.read_text(encoding="utf-8")
    local = ROOT / "local"
    if (local / "models" / "tiny").is_dir() and (local / "data" / "arithmetic" / "sft.jsonl").is_file():
        return EXAMPLE
    print(f"making a tiny model and arithmetic data under {work} (no `make demo` output in {local})")
    made = (("model", "init-tiny", work / "models" / "tiny"),
            ("data", "arithmetic", work / "data" / "arithmetic"))
    for args in made:
        subprocess.run(rollout_command(*map(str, args)), check=True, stdout=subprocess.DEVNULL)
    config = work / "sft-tiny.toml"
    config.write_text(text.replace("../local/", f"{work}/"), encoding="utf-8")
    return config


def reference_commands() -> dict[str, list[str]]:
    """The references beside `rollout --help` on this machine: the interpreter, importing typer, and a
    bare typer app with as many commands drawing its help screen (typer and rich, without the imports
    rollout's CLI defers, so `rollout --help` can come in under it)."""
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import typer'": [sys.executable, "-c", "import typer"],
        "bare typer app --help": [sys.executable, "-c", TYPER_APP],
    }


def run_once(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run; the CPU time is this child's alone (runs are sequential)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def import_times(code: str, top: int, env: dict[str, str]) -> tuple[float, list[tuple[float, str]]]:
    """Sum of the self import times (seconds) and the `top` largest, of `python -X importtime -c CODE`."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env
    )
    rows = []
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.removeprefix("import time:").split("|", 2)
        rows.append((int(self_us) / 1e6, name.strip()))
    rows.sort(reverse=True)
    return sum(s for s, _ in rows), rows[:top]


def child_env(pycache: Path) -> dict[str, str]:
    """The environment every timed command runs in: .pyc files written to and read from `pycache`."""
    skipped = ("ROLLOUT_", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skipped)}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="100", PYTHONPYCACHEPREFIX=str(pycache))
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each command (default 15)")
    parser.add_argument("--config", type=Path, help="config for `validate` (default examples/sft-tiny.toml)")
    parser.add_argument("--importtime", type=int, default=0, metavar="N", help="list the N costliest imports")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rollout-startup-") as tmp:
        config = str(args.config or prepare_config(Path(tmp)))
        env = child_env(Path(tmp) / "pycache")
        commands = {
            **reference_commands(),
            "rollout --help": rollout_command("--help"),
            "rollout validate --no-data": rollout_command("validate", "--config", config, "--no-data"),
            "rollout validate": rollout_command("validate", "--config", config),
        }
        load_before = os.getloadavg()
        for command in commands.values():  # warm-up: file cache, .pyc files
            run_once(command, env)
        walls: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, command in commands.items():
                wall, cpu = run_once(command, env)
                walls[name].append(wall)
                cpus[name].append(cpu)
        load_after = os.getloadavg()

        print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {args.runs} runs each")
        print(f"validate --config {config}")
        print(f"load average (1, 5, 15 min): {_load(load_before)} before, {_load(load_after)} after")
        print(f"{'command':30s} {'wall min':>9s} {'wall med':>9s} {'cpu min':>9s} {'cpu med':>9s}")
        for name in commands:
            w, c = walls[name], cpus[name]
            figures = (min(w), statistics.median(w), min(c), statistics.median(c))
            print(f"{name:30s} {' '.join(_ms(f) for f in figures)}")
        for name in ("rollout --help", "rollout validate"):
            best = min(walls[name])
            verdict = "under" if best < TARGET_S else "OVER"
            print(f"{name}: best wall {best:.3f} s, {verdict} the {TARGET_S} s target")

        for argv in (["--help"], ["validate", "--config", config]) if args.importtime else ():
            code = f"from rollout.cli.main import main; main({argv!r})"
            total, top = import_times(code, args.importtime, env)
            print(f"\nrollout {' '.join(argv)}: {total * 1000:.0f} ms of imports (sum of self times)")
            for seconds, module in top:
                print(f"  {seconds * 1000:7.1f} ms  {module}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.0f}ms"


def _load(values: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    main()
