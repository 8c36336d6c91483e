"""The `rollout` command line.

`rollout --help` imports every sub-command module (it lists their help), so
those modules must stay light: torch, transformers and friends are imported
inside the command functions, which keeps `rollout --help`, `validate` and
`train --dry-run` instant and working without torch installed. So are the
config models (pydantic), the stores and the inference and eval harnesses:
`rollout --help` loads typer and rich only (tests/cli_e2e/test_cli_startup.py,
benchmarks/startup.py).

The rest is made on demand. Typer turns a command into a click command, with
all its parameters, before anything is parsed. `_RolloutGroup` imports a
sub-command's module and makes its command when that command is used
(`rollout validate` imports `config_cmds` only), and a sub-command group's own
commands are made only when that group is used (`_LazyCommands`). typer's
help renderer is loaded without `rich.markdown` and `rich.traceback`, which it
imports but rollout never uses (`_defer_rich_extras`), and pydantic's plugin
loader, which imports `importlib.metadata`, stays a stand-in while the validators
typer and `validate` build have plugins off (`_defer_pydantic_plugin_loader`).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import threading
import traceback
from collections.abc import MutableMapping
from types import ModuleType
from typing import Any

import typer
import typer.main
from typer.core import TyperGroup

from rollout import __version__
from rollout.errors import RolloutError

# Recent typer vendors its own copy of click; catch both so usage errors exit 2, not 1.
# click itself is not imported for that (it costs every start ~20 ms): only code that
# imported it can raise its exceptions (an older typer does, and it imports click first).
try:
    from typer._click.exceptions import ClickException as _TyperClickException
except ImportError:  # older typer raises click's own exceptions
    from click import ClickException as _TyperClickException


def _click(name: str) -> tuple[type[BaseException], ...]:
    """click's exception class `name` once click is imported; none before (none can be raised)."""
    exceptions = sys.modules.get("click.exceptions")
    return () if exceptions is None else (getattr(exceptions, name),)


SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("config_cmds", "register"),
    "schema": ("config_cmds", "register"),
    "plan": ("plan", "register"),
    "run": ("plan", "register"),
    "serve": ("serve", "register"),
    "dashboard": ("dashboard", "register"),
    "train": ("train", "app"),
    "model": ("model", "app"),
    "data": ("data", "app"),
    "snapshot": ("snapshot", "app"),
    "runs": ("runs", "runs_app"),
    "logs": ("runs", "logs_app"),
    "infer": ("infer", "app"),
    "eval": ("eval", "app"),
    "plugins": ("plugins", "app"),
}
"""Every top-level command, in `rollout --help` order: the module under `rollout.cli` that makes it,
and that module's `register(app)` function (it adds the command to `app`) or its sub-app."""


class _RolloutGroup(TyperGroup):
    """The top-level group: a command's module is imported, and its command made, when it is used.
    Listing them (`rollout --help`, suggestions for a mistyped command) makes them all."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in SUBCOMMANDS and cmd_name not in self._commands:
            self._make(cmd_name)
        return self._commands.get(cmd_name)

    @property
    def commands(self) -> MutableMapping[str, Any]:
        if any(name not in self._commands for name in SUBCOMMANDS):
            for name in SUBCOMMANDS:
                if name not in self._commands:
                    self._make(name)
            # The listing's order; a command added to `app` itself (not in SUBCOMMANDS) comes last.
            self._commands = {**{name: self._commands[name] for name in SUBCOMMANDS}, **self._commands}
        return self._commands

    @commands.setter
    def commands(self, value: MutableMapping[str, Any]) -> None:  # TyperGroup.__init__ sets it
        self._commands = value

    def _make(self, name: str) -> None:
        module, attribute = SUBCOMMANDS[name]
        made = _typer()
        thing = getattr(importlib.import_module(f"rollout.cli.{module}"), attribute)
        if attribute == "register":
            thing(made)
        else:
            made.add_typer(_lazy(thing), name=name)
        self._commands.update(typer.main.get_group(made).commands)


def _root(
    log_level: str | None = typer.Option(
        None, "--log-level", metavar="LEVEL",
        help="debug, info (default), warning or error: at warning and error no progress bars or lines,"
        " only warnings and errors. Default: the ROLLOUT_LOG environment variable, else info.",
    ),
) -> None:
    """Options for every command (before its name: `rollout --log-level warning train sft ...`)."""
    from rollout.progress import set_log_level

    set_log_level(log_level)


app = typer.Typer(
    name="rollout",
    help="Post-training for language models: SFT, reward models, DPO/KTO, PPO/GRPO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_RolloutGroup,
    callback=_root,
)


def _typer() -> typer.Typer:
    """An app to make commands in, with the settings the top-level app hands down to them."""
    return typer.Typer(
        rich_markup_mode=app.rich_markup_mode, pretty_exceptions_short=app.pretty_exceptions_short
    )


class _LazyCommands(TyperGroup):
    """A sub-command group whose commands typer makes on first use of `commands` (listing,
    resolving or suggesting a sub-command all go through it). `_lazy` binds `source`."""

    source: typer.Typer
    """The sub-app whose registered commands (and groups) this group holds."""

    @property
    def commands(self) -> MutableMapping[str, Any]:
        if not self._made:
            self._made = True
            made = _typer()
            made.registered_commands = self.source.registered_commands
            made.registered_groups = self.source.registered_groups
            self._commands.update(typer.main.get_group(made).commands)
        return self._commands

    @commands.setter
    def commands(self, value: MutableMapping[str, Any]) -> None:  # TyperGroup.__init__ sets it
        self._commands = value
        self._made = False


def _lazy(sub: typer.Typer) -> typer.Typer:
    """`sub` with its commands made when it is used; its own help, options and callback stay.
    A sub-app with no commands registered (`train`: they come from the algorithm registry, on
    demand) is returned as it is."""
    if not sub.registered_commands and not sub.registered_groups:
        return sub
    lazy = copy.copy(sub)
    lazy.registered_commands, lazy.registered_groups = [], []
    lazy.info = copy.copy(sub.info)
    lazy.info.cls = type("LazyCommands", (_LazyCommands,), {"source": sub})
    return lazy


# ------------------------------------------------------------- help screens without rich.markdown/traceback
# `typer.rich_utils` (imported when typer draws a help screen, a usage error or an abort)
# imports `rich.markdown` (markdown-it, pygments) and `rich.traceback` (attrs, pygments) at its
# top: about 100 ms of CPU, a third of `rollout --help` (benchmarks/startup.py). rollout's help
# texts use rich markup, not markdown, and its pretty tracebacks are off
# (`pretty_exceptions_enable=False`), so neither module draws anything.
#
# `_defer_rich_extras()` (called by `main`) puts a finder first on `sys.meta_path`. When `typer.rich_utils` is imported,
# `rich.markdown` and `rich.traceback` are stand-in modules for the time of that import only
# (then taken out of `sys.modules`, so any later `import rich.markdown` gets the real one).
# The stand-ins' `Markdown` and `Traceback` import the real class on first use and pass every
# call, attribute and `isinstance` check to it, so a markdown help text or a pretty traceback
# still works; it just pays for the import when it happens.

_RICH_UTILS = "typer.rich_utils"
_DEFERRED = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}
"""Module -> the one name `typer.rich_utils` imports from it; see `_defer_rich_extras`."""


class _Deferred(type):
    """Metaclass of a stand-in class: the real class (`_module`.`__name__`) does the work."""

    _module: str

    def _real(cls) -> type:
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:  # names the stand-in lacks: `Traceback.from_exception`
        if name.startswith("__"):  # probes (typing, copy, ...) must not load the real module
            raise AttributeError(name)
        return getattr(cls._real(), name)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._real())


def _stand_in(module: str, name: str) -> ModuleType:
    stand_in = ModuleType(module, f"Stand-in for {module} while {_RICH_UTILS} is imported (rollout.cli.main).")
    setattr(stand_in, name, _Deferred(name, (), {"_module": module}))
    return stand_in


class _RichUtilsLoader:
    """`typer.rich_utils`'s own loader, with the stand-ins in `sys.modules` while it runs."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        stand_ins = {name: _stand_in(name, attr) for name, attr in _DEFERRED.items() if name not in sys.modules}
        sys.modules.update(stand_ins)
        try:
            self.loader.exec_module(module)
        finally:
            for name, stand_in in stand_ins.items():
                if sys.modules.get(name) is stand_in:
                    del sys.modules[name]


class _RichUtilsFinder:
    """Finds `typer.rich_utils` once (the way Python would), hands it `_RichUtilsLoader`, and steps aside."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _RICH_UTILS:
            return None
        _take_off_meta_path(_RichUtilsFinder)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RichUtilsLoader(spec.loader)
        return spec


def _defer_rich_extras() -> None:
    """Defer the two modules for the next import of `typer.rich_utils` (nothing if it is loaded)."""
    _put_first_on_meta_path(_RichUtilsFinder, _RICH_UTILS)


def _put_first_on_meta_path(finder: type, module: str) -> None:
    """A `finder()` first on `sys.meta_path` for `module`'s next import, unless it is loaded or one is there."""
    if module not in sys.modules and not any(isinstance(f, finder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder())


def _take_off_meta_path(finder: type) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, finder)]


# pydantic asks `pydantic.plugin._loader.get_plugins()` each time it builds a validator, and that
# module imports `importlib.metadata` (and with it `email`, `zipfile`, `socket`...: ~50 M instructions,
# 4.6% of `rollout validate`'s) only for the entry-point scan it runs when plugins are on. typer builds
# its parameters' validators, and `validate` rollout's config models, with plugins off
# (PYDANTIC_DISABLE_PLUGINS=1; `config_base.pydantic_plugins_off`), when `get_plugins` returns () at
# once. `_defer_pydantic_plugin_loader()` (called by `main`) puts a finder first on `sys.meta_path`:
# when pydantic imports that module, it gets a stand-in whose `get_plugins` answers () as the real one
# does while plugins are off. With plugins on, or for any other name, the stand-in takes itself and
# the finder out, imports the real module and hands over to it: plugins load exactly as they would have.

_PYDANTIC_LOADER = "pydantic.plugin._loader"
_HANDOVER = threading.Lock()
_PLUGINS_OFF = ("__all__", "1", "true")
"""The values of PYDANTIC_DISABLE_PLUGINS for which pydantic's `get_plugins` returns () (2.14's `_loader`;
tests/cli_e2e/test_cli_startup.py checks the stand-in against the installed pydantic with a real plugin)."""


class _PydanticLoaderStandIn(ModuleType):
    """`pydantic.plugin._loader` until it is needed with plugins on (see `_defer_pydantic_plugin_loader`)."""

    def get_plugins(self) -> Any:
        if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in _PLUGINS_OFF:
            return ()
        return self._real().get_plugins()

    def __getattr__(self, name: str) -> Any:  # any other name (`_plugins`, `entry_points`...): the real module's
        if name.startswith("__"):  # probes (the import system, copy, typing...) must not load the real module
            raise AttributeError(name)
        return getattr(self._real(), name)

    def _real(self) -> ModuleType:
        with _HANDOVER:  # two threads handing over at once: one real module, never one taken out
            _take_off_meta_path(_PydanticLoaderFinder)
            if sys.modules.get(_PYDANTIC_LOADER) is self:
                del sys.modules[_PYDANTIC_LOADER]
            return importlib.import_module(_PYDANTIC_LOADER)


class _PydanticLoaderFinder:
    """Makes the stand-in when pydantic first imports its plugin loader (a finder and loader in one)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname == _PYDANTIC_LOADER else None

    def create_module(self, spec: Any) -> ModuleType:
        return _PydanticLoaderStandIn(spec.name, "Stand-in for pydantic's plugin loader (rollout.cli.main).")

    def exec_module(self, module: ModuleType) -> None:
        pass


def _defer_pydantic_plugin_loader() -> None:
    """The stand-in for pydantic's plugin loader's first import (nothing if it is loaded)."""
    _put_first_on_meta_path(_PydanticLoaderFinder, _PYDANTIC_LOADER)


def report_error(err: RolloutError) -> None:
    """One clear line first, details after (SPEC section 2)."""
    print(f"error: {err}", file=sys.stderr)
    for line in err.details:
        print(f"  {line}", file=sys.stderr)


def report_bug(ex: BaseException) -> None:
    """An unexpected exception: one line saying so first (what failed, where to report it), the
    traceback after it (SPEC section 2)."""
    what = str(ex).strip().splitlines()
    print(
        f"error: this is a bug in rollout ({type(ex).__name__}{': ' + what[0] if what else ''});"
        f" please report it with the traceback below (rollout {_version()}, python {sys.version.split()[0]},"
        f" pid {os.getpid()})",
        file=sys.stderr,
    )
    traceback.print_exception(ex, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # transformers/hub draw their own tqdm bars on stderr (weights loading, shard
    # writing); they would push a later error off stderr's first line. We draw our own.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _defer_rich_extras()  # help screens without rich.markdown and rich.traceback (~100 ms)
    _defer_pydantic_plugin_loader()  # validators built with plugins off import no importlib.metadata (~12 ms)
    try:
        app(args=argv, standalone_mode=False, prog_name="rollout")
    except RolloutError as err:
        report_error(err)
        sys.exit(2)
    except (*_click("Exit"), typer.Exit) as ex:
        sys.exit(ex.exit_code)
    except (*_click("Abort"), typer.Abort):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except (*_click("ClickException"), _TyperClickException) as ex:  # usage errors: exit 2 like click does
        ex.show()
        sys.exit(ex.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as ex:
        report_bug(ex)
        sys.exit(1)
    return 0


def _version() -> str:
    return __version__


if __name__ == "__main__":
    main()
