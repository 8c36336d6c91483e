"""`rollout plan --config F [-o plan.lock]` and `rollout run --plan plan.lock [--resume ID]`.

    rollout validate --config examples/sft-tiny.toml              # config + every dataset line (no torch)
    rollout plan --config examples/sft-tiny.toml -o plan.lock     # + tokenizer, lengths, plugins, memory, digests
    rollout run --plan plan.lock                                  # refuses if any pinned file or package changed
    rollout logs tail <run-id> --config examples/sft-tiny.toml

`plan` prints a summary (rich tables on a terminal, `key=value` lines otherwise) and, with
`-o`, writes the lock (`rollout.plan_lock`, docs/plan-lock.md). `run` re-checks the lock and
then runs the locked config exactly as `rollout train <kind>` would. torch and transformers are
imported inside the commands only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rollout.cli.train import RESUME, run_training
from rollout.errors import ConfigError

if TYPE_CHECKING:
    from rollout.plan import Plan
    from rollout.plan_lock import Drift

CONFIG = typer.Option(..., "--config", "-c", help="Run config (TOML).")
OUTPUT = typer.Option(None, "--output", "-o", help="Write the plan lock (JSON) here.")
PLAN = typer.Option(..., "--plan", help="A lock written by `rollout plan -o`.")


def plan(config: Path = CONFIG, output: Path | None = OUTPUT) -> None:
    """Full plan-time validation: config, every dataset line, tokenizer and chat template, lengths,
    plugins and sidecars, a memory estimate against the device; -o writes the lock. Given a
    pipeline file (a list of stages), plans every stage."""
    from rollout.pipeline import is_pipeline_file, pipeline_lock, plan_pipeline
    from rollout.plan import make_plan
    from rollout.plan_lock import write_lock

    if is_pipeline_file(config):
        _, stages = plan_pipeline(config)
        for stage in stages:
            _print(stage.plan, prefix=f"stage {stage.name}: ")
            for key, source in stage.inputs.items():  # the checks above ran on a stand-in for it
                typer.echo(f"stage {stage.name}: {key} <- stage {source['stage']}: {source['path']}")
        typer.echo(f"pipeline OK: {len(stages)} stages ({' -> '.join(s.name for s in stages)})")
        if output is not None:
            lock = pipeline_lock(config, stages)
            write_lock(lock, output)
            pinned = len(lock["files"]) + sum(len(s["files"]) for s in lock["stages"])
            typer.echo(f"lock written: {output} ({pinned} files pinned)")
        return
    result = make_plan(config)
    _print(result)
    if output is not None:
        write_lock(result.lock(), output)
        typer.echo(f"lock written: {output} ({len(result.files)} files pinned)")


def run(plan_file: Path = PLAN, resume: str | None = RESUME) -> None:
    """Run a planned config (or pipeline); refuses (exit 2) if a pinned file, a package version or
    the device changed since `rollout plan`."""
    from rollout.pipeline import check_pipeline_files, run_pipeline
    from rollout.plan_lock import check_device, check_lock, check_packages, locked_config, read_lock
    from rollout.plan_memory import probe_device

    lock = read_lock(plan_file)
    if lock.get("kind") == "pipeline":
        if resume is not None:
            raise ConfigError("--resume is for one run: a pipeline resumes its first unfinished stage by itself")
        device = probe_device(lock["stages"][0]["config"]["backend"]["device"])
        _refuse_drift(plan_file, check_pipeline_files(lock) + check_packages(lock["packages"])
                      + check_device(lock["device"], device.identity()))
        typer.echo(f"plan {plan_file}: every pinned file, package and the device unchanged")
        run_pipeline(plan_file, lock, run_training, typer.echo)
        return
    from rollout.distributed import under_launcher
    from rollout.plan_lock import LOCK_CHECKED_ENV, lock_stamp

    cfg = locked_config(lock, source=plan_file)
    if not (under_launcher() and os.environ.get(LOCK_CHECKED_ENV) == lock_stamp(plan_file)):
        # (torchrun's ranks skip this when the `run --plan` that started them checked this very lock)
        device = probe_device(cfg.backend.device)
        cfg, drift = check_lock(plan_file, device_identity=device.identity())
        _refuse_drift(plan_file, drift)
    if not under_launcher():
        typer.echo(f"plan {plan_file}: every pinned file, package and the device unchanged")
        if cfg.distributed.kind == "torchrun":  # one process per rank, as `rollout train` starts them
            from rollout.launch import launch_torchrun

            args = ["run", "--plan", str(plan_file.resolve()), *(["--resume", resume] if resume else [])]
            sys.exit(launch_torchrun(cfg, args, resume=resume, env={LOCK_CHECKED_ENV: lock_stamp(plan_file)}))
    run_training(cfg, resume)


def _refuse_drift(plan_file: Path, drift: list[Drift]) -> None:
    if drift:
        raise ConfigError(
            f"{plan_file}: {drift[0].message}",
            details=[d.message for d in drift[1:]] + ["nothing ran; plan again: rollout plan --config F -o LOCK"],
        )


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
    app.command("run")(run)


# --------------------------------------------------------------------------- the summary


def _summary_rows(p: Plan) -> list[tuple[str, str]]:
    from rollout.plan_memory import format_bytes

    s = p.config.algorithm.settings
    rows = [
        ("config", str(p.config_path)),
        ("algorithm", p.config.algorithm.kind),
        ("model", s.base_model.uri + (f" ({p.model.architecture}, {p.model.num_params:,} parameters)" if p.model else "")),
        ("data", f"{p.data.label}: {p.data.num_valid} lines" + (f", {p.data.num_skipped} skipped" if p.data.num_skipped else "")),
    ]
    device = p.device
    memory = f"{format_bytes(device.host_total_bytes)} RAM ({format_bytes(device.host_available_bytes)} free)"
    if device.gpus:
        memory = ", ".join(f"{name} {format_bytes(total)}" for name, total in device.gpus) + f"; {memory}"
    rows.append(("device", f"{device.kind}: {memory}"))
    rows.append(("files", f"{len(p.files)} pinned (blake3)"))
    return rows


def _length_words(p: Plan) -> str:
    n = p.lengths
    assert n is not None
    pct = " ".join(f"{k}={v}" for k, v in n.percentiles.items())
    return (f"{n.what}={n.count} {pct} max_seq_len={n.max_seq_len} over_max_seq_len={n.over} ({n.action})"
            f" dropped={n.dropped}")


def _memory_words(p: Plan) -> str:
    from rollout.plan_memory import format_bytes

    m = p.memory
    assert m is not None
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in m.parts.items() if v)
    host = f" (host {format_bytes(m.host_bytes)})" if m.device == "cuda" else ""
    return f"estimated peak {format_bytes(m.total_bytes)} on {m.device}{host} at {m.peak_phase}: {parts}"


def _print(p: Plan, *, prefix: str = "") -> None:
    if sys.stdout.isatty():
        if prefix:
            typer.echo(prefix.rstrip(": "))
        _print_rich(p)
    else:
        _print_plain(p, prefix)


def _print_plain(p: Plan, prefix: str = "") -> None:
    def echo(line: str) -> None:
        typer.echo(prefix + line)

    echo(f"plan OK: algorithm={p.config.algorithm.kind} model={p.config.algorithm.settings.base_model.uri}"
         f" dataset={p.data.label} lines={p.data.num_valid}"
         + (f" skipped={p.data.num_skipped}" if p.data.num_skipped else ""))
    if p.lengths is not None:
        echo(f"lengths: {_length_words(p)}")
    for check in p.plugins:
        echo(f"{check.role}: {check.name} ({check.origin}) {check.detail}")
    if p.memory is not None:
        echo(f"memory: {_memory_words(p)}")
    echo(f"device: {dict(_summary_rows(p))['device']}")
    for warning in p.warnings:
        echo(f"warning: {warning}")


def _print_rich(p: Plan) -> None:
    from rollout.cli.snapshot import key_value_table, new_table, print_tables
    from rollout.plan_memory import format_bytes

    tables = [key_value_table(_summary_rows(p), title="plan OK")]
    if p.lengths is not None:
        n = p.lengths
        table = new_table("tokens", *n.percentiles, "max_seq_len", f"over ({n.action})", "dropped",
                          title=f"lengths of {n.count} {n.what}")
        table.add_row("", *map(str, n.percentiles.values()), str(n.max_seq_len), str(n.over), str(n.dropped))
        tables.append(table)
    if p.plugins:
        table = new_table("role", "name", "origin", "checked", title="plugins")
        for check in p.plugins:
            table.add_row(check.role, check.name, check.origin, check.detail)
        tables.append(table)
    if p.memory is not None:
        m = p.memory
        table = new_table("part", "bytes", title=f"memory: {format_bytes(m.total_bytes)} peak ({m.peak_phase}, {m.device})")
        for key, value in m.parts.items():
            if value:
                table.add_row(key, format_bytes(value))
        tables.append(table)
    print_tables(*tables)
    for warning in p.warnings:
        typer.echo(f"warning: {warning}")
