"""`rollout validate` and `rollout schema`: config checks that never import torch.

The config models (pydantic), the algorithm registry and the dataset readers are
imported inside the functions: `rollout --help` and the commands that need no
config never load them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rollout.errors import ModelError

if TYPE_CHECKING:
    from rollout.config import RunConfig


def check_dataset_files(cfg: RunConfig, *, source: Path) -> None:
    """Every file or folder the dataset block names exists; a missing one is located in the config
    (`run.toml:12: algorithm.sft.dataset.path: dataset not found: /data/sft.jsonl`)."""
    from rollout.config_base import located_error
    from rollout.data.sources import check_dataset_exists
    from rollout.errors import DataError

    ds = cfg.algorithm.settings.dataset
    try:
        check_dataset_exists(ds)
    except DataError as err:
        key = "sources" if ds.kind == "mixture" else "path"
        raise located_error(source, ["algorithm", cfg.algorithm.kind, "dataset", key], str(err)) from None


def check_dataset(cfg: RunConfig, *, scan_lines: bool, source: Path) -> str:
    """The dataset exists (and, with scan_lines, every line has the algorithm's shape)."""
    from rollout.algorithms.registry import ALGORITHMS
    from rollout.data.sources import dataset_label, scan_dataset_source

    ds = cfg.algorithm.settings.dataset
    check_dataset_files(cfg, source=source)
    if not scan_lines:
        return f"dataset={dataset_label(ds)}"
    report = scan_dataset_source(ds, ALGORITHMS[cfg.algorithm.kind].data_kind)
    skipped = f" skipped={report.num_skipped}" if report.num_skipped else ""
    return f"dataset={dataset_label(ds)} lines={report.num_valid}{skipped}"


def check_runtime(cfg: RunConfig, *, source: Path) -> None:
    """The algorithm runs on the configured backend and under the configured distribution
    (the registry lists what each algorithm implements)."""
    from rollout.algorithms.registry import ALGORITHMS
    from rollout.config_base import located_error

    spec = ALGORITHMS[cfg.algorithm.kind]
    for block, kind, implemented in (("backend", cfg.backend.kind, spec.backends),
                                     ("distributed", cfg.distributed.kind, spec.distributed)):
        if kind not in implemented:
            choices = " or ".join(f'"{k}"' for k in implemented)
            raise located_error(source, [block, "kind"], f'"{kind}" is not implemented for {spec.kind} (use {choices})')
    if cfg.backend.kind == "fsdp":
        _check_fsdp_backend(cfg, source=source)
    if cfg.distributed.kind == "torchrun":
        from rollout.distributed import check_torchrun

        check_torchrun(cfg, source=source)
    if cfg.distributed.kind == "ray":
        from rollout.distributed import check_ray

        check_ray(cfg, source=source)


def _check_fsdp_backend(cfg: RunConfig, *, source: Path) -> None:
    """`[backend] kind = "fsdp"` needs ranks to shard over, and no other sharding named for them."""
    from rollout.config_base import located_error

    dist = cfg.distributed
    if dist.kind == "local" or (dist.kind == "ray" and dist.num_learners == 1):
        raise located_error(
            source, ["backend", "kind"],
            '"fsdp" shards the model over a process group: set [distributed] kind = "torchrun" (or "ray" with'
            ' num_learners > 1), or use kind = "torch" in one process',
        )
    if dist.sharding != "fsdp":
        raise located_error(source, ["distributed", "sharding"],
                            f'"{dist.sharding}" contradicts [backend] kind = "fsdp" (drop one of them)')


def check_model_path(cfg: RunConfig) -> None:
    """A local model folder (anything that resolved to a path) must exist."""
    s = cfg.algorithm.settings
    reference = getattr(s, "reference", None)
    for uri in (s.base_model.uri, reference.uri if reference is not None else None):
        if uri is not None and Path(uri).is_absolute() and not Path(uri).is_dir():
            raise ModelError(f"model not found: {uri}")


def check_eval(cfg: RunConfig, *, source: Path, plugins: bool = True) -> str:
    """`[eval]`'s env resolves, its data exists, and every row it evaluates starts an episode.
    `plugins=False` (`validate`): an env that is not built in (a plugin, 'module:attr', a sidecar)
    is neither imported nor started; only its data file is checked."""
    if cfg.eval is None:
        return ""
    from rollout.config_base import located_error
    from rollout.rl.builtins import BUILTIN_ENVS

    if not cfg.eval.data.is_file():
        raise located_error(source, ["eval", "data"], f"not found: {cfg.eval.data}")
    if not plugins and not (isinstance(cfg.eval.env, str) and cfg.eval.env in BUILTIN_ENVS):
        return f" eval={cfg.eval.data} every_steps={cfg.eval.every_steps}"
    # Imported here: the eval harness pulls in asyncio and the RL envs, which most configs never need.
    from rollout.eval.during_training import load_periodic_eval

    evals = load_periodic_eval(cfg.eval)
    return f" eval={evals.data.path} prompts={len(evals.data.rows)} every_steps={evals.every_steps}"


@contextmanager
def _short_command() -> Iterator[None]:
    """How `validate` runs: no cyclic collection while the config models load and the lines are
    scanned (the scan's objects die by reference count; a collection would only rescan the
    modules), no pydantic plugin scan for rollout's own models, and no collection of the heap at
    exit. Together ~10% of validate's instructions and ~15% of its time (`benchmarks/startup.py`)."""
    from rollout.setup_gc import freeze_at_exit, paused_for_setup

    freeze_at_exit()
    with paused_for_setup():
        from rollout.config_base import pydantic_plugins_off  # imports pydantic: inside the pause

        with pydantic_plugins_off():
            yield


def validate(
    config: Path = typer.Option(..., "--config", "-c", help="Run config (TOML)."),
    no_data: bool = typer.Option(False, "--no-data", help="Skip scanning the dataset's lines."),
) -> None:
    """Parse and validate a run config and its dataset's lines (no model, no plugins)."""
    # Reward and env names were checked against the built-ins and the installed plugins' metadata
    # while parsing; a 'module:attr' reference is imported by `plan` and `train`, not here.
    with _short_command():
        from rollout.config import load_config

        cfg = load_config(config)
        check_runtime(cfg, source=config)
        data = check_dataset(cfg, scan_lines=not no_data, source=config)
        if not no_data:
            data += check_eval(cfg, source=config, plugins=False)
    s = cfg.algorithm.settings
    typer.echo(f"config OK: algorithm={cfg.algorithm.kind} model={s.base_model.uri} {data}")


def schema() -> None:
    """Print the JSON Schema of the run config."""
    from rollout.config import RunConfig

    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2, sort_keys=True))


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
    app.command("schema")(schema)
