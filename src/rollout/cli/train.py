"""`rollout train sft|rm --config F [--resume ID] [--dry-run]`."""

from __future__ import annotations

from pathlib import Path

import typer

from rollout.cli.config_cmds import check_dataset, check_model_path, check_plugins
from rollout.config import load_config
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
    if dry_run:
        check_dataset(cfg, scan_lines=False)
        typer.echo(
            f"dry-run OK: algorithm={kind} model={s.base_model.uri} minibatch={s.minibatch_size} dataset={s.dataset.path}"
        )
        return
    check_dataset(cfg, scan_lines=True)
    check_model_path(cfg)
    check_plugins(cfg)
    if kind == "sft":
        from rollout.algorithms.sft import train_sft as run
    elif kind == "rm":
        from rollout.algorithms.rm import train_rm as run
    elif kind == "dpo":
        from rollout.algorithms.dpo import train_dpo as run
    elif kind == "kto":
        from rollout.algorithms.kto import train_kto as run
    elif kind == "grpo":
        from rollout.algorithms.grpo import train_grpo as run
    else:
        from rollout.algorithms.ppo import train_ppo as run
    result = run(cfg, resume=resume)
    metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
    typer.echo(f"run {result.run_id} succeeded after {result.steps} steps")
    typer.echo(f"final snapshot {result.final_snapshot_id}")
    typer.echo(f"metrics {metrics}")
    typer.echo(f"store {cfg.storage.embedded.path if cfg.storage.backend == 'embedded' else 'postgres'}"
               f" objects {cfg.storage.objects.path} events {cfg.storage.resolved_runs_dir() / result.run_id}")
    if s.export is not None:
        typer.echo(f"exported model {s.export.dir}")


@app.command("sft")
def sft(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """Supervised fine-tuning."""
    _train("sft", config, resume, dry_run)


@app.command("rm")
def rm(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """Bradley–Terry reward model."""
    _train("rm", config, resume, dry_run)


@app.command("dpo")
def dpo(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """Direct preference optimisation (loss_type sigmoid | ipo | hinge | robust)."""
    _train("dpo", config, resume, dry_run)


@app.command("kto")
def kto(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """Kahneman–Tversky optimisation on unpaired good/bad completions."""
    _train("kto", config, resume, dry_run)


@app.command("grpo")
def grpo(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """Group relative policy optimisation against rewards / a verifiable env."""
    _train("grpo", config, resume, dry_run)


@app.command("ppo")
def ppo(config: Path = CONFIG, resume: str | None = RESUME, dry_run: bool = DRY_RUN) -> None:
    """PPO with a value head, GAE and a KL penalty in the reward."""
    _train("ppo", config, resume, dry_run)
