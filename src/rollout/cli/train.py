"""`rollout train <kind> --config F [--resume ID] [--dry-run]`, one sub-command per registered algorithm."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from rollout.algorithms.registry import ALGORITHMS, TrainResult
from rollout.cli.config_cmds import check_dataset, check_eval, check_model_path, check_plugins, check_runtime
from rollout.config import RunConfig, load_config
from rollout.distributed import under_launcher
from rollout.errors import ConfigError

app = typer.Typer(help="Plan and run a training job in one go.", no_args_is_help=True)

CONFIG = typer.Option(..., "--config", "-c", help="Run config (TOML).")
RESUME = typer.Option(None, "--resume", help="Snapshot id (or unique prefix of >= 8 hex chars) to resume from.")
DRY_RUN = typer.Option(False, "--dry-run", help="Check config, algorithm kind and dataset path; no torch.")


def _train(kind: str, config: Path, resume: str | None, dry_run: bool) -> None:
    cfg = load_config(config)
    if cfg.algorithm.kind != kind:
        raise ConfigError(
            f"{config}: algorithm.kind is {cfg.algorithm.kind!r} but this is `rollout train {kind}`"
        )
    s = cfg.algorithm.settings
    check_runtime(cfg, source=config)
    if dry_run:
        data = check_dataset(cfg, scan_lines=False)
        typer.echo(f"dry-run OK: algorithm={kind} model={s.base_model.uri} minibatch={s.minibatch_size} {data}")
        return
    check_dataset(cfg, scan_lines=True)
    check_model_path(cfg)
    check_plugins(cfg)
    check_eval(cfg, source=config)
    if cfg.distributed.kind == "torchrun" and not under_launcher():  # one process per rank, through torchrun
        from rollout.launch import launch_torchrun

        args = ["train", kind, "--config", str(config.resolve()), *(["--resume", resume] if resume else [])]
        sys.exit(launch_torchrun(cfg, args, resume=resume))  # torchrun's status (typer.Exit's code is dropped by main)
    run_training(cfg, resume)


def run_training(cfg: RunConfig, resume: str | None) -> TrainResult | None:
    """Run a checked config through its algorithm's recipe and print the summary
    (`rollout train <kind>` and `rollout run --plan` both end here). None on ranks other than 0."""
    s = cfg.algorithm.settings
    if cfg.distributed.kind == "torchrun" and not under_launcher():
        raise ConfigError(
            "this command does not start torchrun yet: run `rollout train <kind> --config F` (it launches"
            " itself through torchrun) or start it with `torchrun -m rollout.cli.main ...`"
        )
    train = ALGORITHMS[cfg.algorithm.kind].load_train()  # the recipe (and torch) load only now
    result = train(cfg, resume=resume)
    if os.environ.get("RANK", "0") != "0":
        return None  # rank 0 reports the run
    metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
    typer.echo(f"run {result.run_id} succeeded after {result.steps} steps")
    typer.echo(f"final snapshot {result.final_snapshot_id}")
    typer.echo(f"metrics {metrics}")
    typer.echo(f"store {cfg.storage.embedded.path if cfg.storage.backend == 'embedded' else 'postgres'}"
               f" objects {cfg.storage.objects.path} events {cfg.storage.resolved_runs_dir() / result.run_id}")
    if s.export is not None:
        typer.echo(f"exported model {s.export.dir}")
    return result


def _command(kind: str) -> Callable[..., None]:
    def command(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
        _train(kind, config, resume, dry_run)

    command.__name__ = kind
    return command


for _spec in ALGORITHMS.values():
    app.command(_spec.kind, help=_spec.summary)(_command(_spec.kind))
