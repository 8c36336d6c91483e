"""The `rollout` command line.

Every sub-command module is imported here, so those modules must stay light:
torch, transformers and friends are imported inside the command functions,
which keeps `rollout --help`, `validate` and `train --dry-run` instant and
working without torch installed.
"""

from __future__ import annotations

import os
import sys
import traceback

import click
import typer

from rollout import __version__
from rollout.cli import config_cmds, dashboard, data, infer, model, runs, serve, snapshot, train
from rollout.cli import eval as eval_cli
from rollout.cli import plan as plan_cli
from rollout.cli import plugins as plugins_cli
from rollout.errors import RolloutError

# Recent typer vendors its own copy of click; catch both so usage errors exit 2, not 1.
try:
    from typer._click.exceptions import ClickException as _TyperClickException
except ImportError:  # older typer raises click's own exceptions
    _TyperClickException = click.ClickException
_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_CLICK_ERROR = (click.ClickException, _TyperClickException)

app = typer.Typer(
    name="rollout",
    help="Post-training for language models: SFT, reward models, DPO/KTO, PPO/GRPO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    config_cmds.register(app)
    plan_cli.register(app)
    app.add_typer(train.app, name="train")
    app.add_typer(model.app, name="model")
    app.add_typer(data.app, name="data")
    app.add_typer(snapshot.app, name="snapshot")
    app.add_typer(runs.runs_app, name="runs")
    app.add_typer(runs.logs_app, name="logs")
    app.add_typer(infer.app, name="infer")
    app.add_typer(eval_cli.app, name="eval")
    app.add_typer(plugins_cli.app, name="plugins")
    serve.register(app)
    dashboard.register(app)


_register()


def report_error(err: RolloutError) -> None:
    """One clear line first, details after (SPEC section 2)."""
    print(f"error: {err}", file=sys.stderr)
    for line in err.details:
        print(f"  {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # transformers/hub draw their own tqdm bars on stderr (weights loading, shard
    # writing); they would push a later error off stderr's first line. We draw our own.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app(args=argv, standalone_mode=False, prog_name="rollout")
    except RolloutError as err:
        report_error(err)
        sys.exit(2)
    except _EXIT as ex:
        sys.exit(ex.exit_code)
    except _ABORT:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except _CLICK_ERROR as ex:  # usage errors: exit 2 like click does
        ex.show()
        sys.exit(ex.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        print(
            "error: this is a bug in rollout, please report it with the traceback above"
            f" (rollout {_version()}, python {sys.version.split()[0]}, pid {os.getpid()})",
            file=sys.stderr,
        )
        sys.exit(1)
    return 0


def _version() -> str:
    return __version__


if __name__ == "__main__":
    main()
