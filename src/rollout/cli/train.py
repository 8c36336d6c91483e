"""`rollout train <kind> --config F [--resume ID] [--dry-run]`, one sub-command per registered algorithm.

The sub-commands come from the algorithm registry, which builds the config models
and scans the installed plugins: `_AlgorithmGroup` makes them the first time the
`train` group is asked for its commands, so `rollout --help` and the other commands
never import the registry (or pydantic).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from rollout.errors import ConfigError

if TYPE_CHECKING:
    from rollout.algorithms.registry import TrainResult
    from rollout.config import RunConfig

CONFIG = typer.Option(..., "--config", "-c", help="Run config (TOML).")
RESUME = typer.Option(None, "--resume", help="Snapshot id (or unique prefix of >= 8 hex chars) to resume from.")
DRY_RUN = typer.Option(False, "--dry-run", help="Check config, algorithm kind and dataset path; no torch.")


def _train(kind: str, config: Path, resume: str | None, dry_run: bool) -> None:
    """`--dry-run`: the config and the dataset's files. Otherwise every check `rollout plan` makes
    (`make_plan`, without the lock's file digests: each line tokenised, plugins and sidecars,
    the memory estimate against the device; its warnings printed), then the run. Under torchrun
    the launching process plans and the ranks, which it starts with the same arguments, do not."""
    from rollout.cli.config_cmds import check_dataset, check_runtime
    from rollout.config import load_config
    from rollout.distributed import under_launcher

    cfg = load_config(config)
    if cfg.algorithm.kind != kind:
        raise ConfigError(
            f"{config}: algorithm.kind is {cfg.algorithm.kind!r} but this is `rollout train {kind}`"
        )
    s = cfg.algorithm.settings
    check_runtime(cfg, source=config)
    if dry_run:
        data = check_dataset(cfg, scan_lines=False, source=config)
        typer.echo(f"dry-run OK: algorithm={kind} model={s.base_model.uri} minibatch={s.minibatch_size} {data}")
        return
    from rollout.setup_gc import paused_for_setup

    here = cfg.distributed.kind == "local" or (cfg.distributed.kind == "ray" and cfg.distributed.num_learners == 1)
    with paused_for_setup(here or under_launcher()):  # the recipe runs in this process: no GC until its loop
        if not under_launcher():
            from rollout.plan import make_plan

            for warning in make_plan(config, config=cfg, pin=False, hand_off=here).warnings:  # the recipe runs here
                typer.echo(f"warning: {warning}", err=True)

        if cfg.distributed.kind == "torchrun" and not under_launcher():  # one process per rank, through torchrun
            from rollout.launch import launch_torchrun

            args = ["train", kind, "--config", str(config.resolve()), *(["--resume", resume] if resume else [])]
            sys.exit(launch_torchrun(cfg, args, resume=resume))  # torchrun's status (typer.Exit's code is dropped by main)
        run_training(cfg, resume)


def run_training(cfg: RunConfig, resume: str | None) -> TrainResult | None:
    """Run a checked config through its algorithm's recipe and print the summary
    (`rollout train <kind>`, `rollout run --plan` and a pipeline's stages end here). None on ranks
    other than 0. A torchrun config must already be under torchrun: `train` and `run --plan`
    relaunch themselves through it first; a pipeline's stages do not yet."""
    from rollout.algorithms.registry import ALGORITHMS
    from rollout.distributed import under_launcher

    s = cfg.algorithm.settings
    if cfg.distributed.kind == "torchrun" and not under_launcher():
        raise ConfigError(
            "a pipeline's stages do not start torchrun yet: run the stage with `rollout train <kind> --config F`"
            " or `rollout run --plan LOCK` (both launch themselves through torchrun)"
        )
    if cfg.distributed.kind == "ray" and cfg.distributed.num_learners > 1 and not under_launcher():
        from rollout.rl.ray_learners import run_learner_group

        result = run_learner_group(cfg, resume)  # learner actors run the recipe; learner 0's result
    else:
        from rollout.setup_gc import paused_for_setup

        with paused_for_setup():  # `run --plan` and a pipeline's stages too (inside `train`'s pause: a no-op)
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


class _AlgorithmGroup(TyperGroup):
    """The `train` group: its commands, one per algorithm, are made on first use of `commands`
    (listing, resolving or suggesting a sub-command all go through it)."""

    @property
    def commands(self) -> MutableMapping[str, Any]:
        if not self._algorithms_added:
            self._algorithms_added = True
            from rollout.algorithms.registry import ALGORITHMS

            algorithms = typer.Typer()
            for spec in ALGORITHMS.values():
                algorithms.command(spec.kind, help=spec.summary)(_command(spec.kind))
            self._commands.update(typer.main.get_group(algorithms).commands)
        return self._commands

    @commands.setter
    def commands(self, value: MutableMapping[str, Any]) -> None:  # TyperGroup.__init__ sets it
        self._commands = value
        self._algorithms_added = False


app = typer.Typer(help="Plan and run a training job in one go.", no_args_is_help=True, cls=_AlgorithmGroup)
