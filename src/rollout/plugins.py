"""In-process plugins (SPEC section 11): envs, reward functions, tools and algorithms that
installed packages register as Python entry points in the group `rollout.plugins`.

    # a plugin package's pyproject.toml: the entry point's name is "<kind>.<name>"
    [project.entry-points."rollout.plugins"]
    "reward.exact" = "my_pkg.rewards:exact"          # a reward function
    "env.chess" = "my_pkg.envs:ChessEnv"             # an env factory
    "tool.search" = "my_pkg.tools:search"            # a function or a `Tool`
    "algorithm.my_algo" = "my_pkg.algo:SPEC"         # an `AlgorithmSpec` whose kind is "my_algo"

A config then names the plugin like a built-in (`name = "exact"`); `rollout plugins list`
shows what is installed. The kind is the entry point name's prefix, so listing and
resolving a name read the installed packages' metadata only: no plugin module is imported
until a config uses it (`rollout --help` and `validate` stay fast). Algorithms are the
exception: their settings class is part of the config schema, so the registry imports
them when it loads (keep that module light; the recipe itself loads through
`AlgorithmSpec.train`).

A name is unique per kind: two packages registering one name, or a package shadowing a
built-in, is a `ConfigError` naming both origins when that name is resolved (and in
`rollout plugins list`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from rollout.errors import ConfigError
from rollout.rl.builtins import BUILTIN_ENVS, BUILTIN_REWARDS, BUILTIN_TOOLS
from rollout.rl.refs import load_ref

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GROUP = "rollout.plugins"
PluginKind = Literal["reward", "env", "tool", "algorithm"]
KINDS: tuple[PluginKind, ...] = get_args(PluginKind)
BUILTIN = "built-in"

_BUILTINS: dict[PluginKind, Mapping[str, str]] = {
    "reward": BUILTIN_REWARDS, "env": BUILTIN_ENVS, "tool": BUILTIN_TOOLS,
}
_WHAT: dict[PluginKind, str] = {"reward": "reward function", "env": "env", "tool": "tool", "algorithm": "algorithm"}


@dataclass(frozen=True)
class Plugin:
    """One named env, reward function, tool or algorithm: built in, or from an installed package."""

    kind: PluginKind
    name: str
    ref: str
    """"module:attr" of the object."""
    origin: str
    """"built-in", or the distribution that registered it as "name==version"."""

    @property
    def where(self) -> str:
        """The origin with the reference, for messages: "my-plugins==0.1 (my_pkg.envs:Chess)"."""
        return f"{'the built-in' if self.origin == BUILTIN else self.origin} ({self.ref})"

    def load(self) -> object:
        """Import the module and return the object (a located `ConfigError` on any failure)."""
        return load_object(self.ref, what=self._what)

    def load_callable(self) -> object:
        """`load`, and the object must be callable (a reward function, an env factory, a tool)."""
        return load_ref(self.ref, what=self._what)

    @property
    def _what(self) -> str:
        return _WHAT[self.kind] if self.origin == BUILTIN else f"{_WHAT[self.kind]} {self.name!r} from {self.origin}"


def load_object(ref: str, *, what: str) -> object:
    """`module:attr` -> the object; unlike `rl.refs.load_ref` it need not be callable (an `AlgorithmSpec`)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"bad {what} reference {ref!r}: expected 'module:attr'")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as err:  # a missing module or one that fails while importing: report it located
        raise ConfigError(f"importing module {module_name!r} for {what} failed: {type(err).__name__}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (for {what})")
        obj = getattr(obj, part)
    return obj


# --- discovery ---------------------------------------------------------------------------


@functools.cache
def entry_point_plugins() -> tuple[tuple[Plugin, ...], tuple[str, ...]]:
    """(plugins, problems) registered by installed packages, read from their metadata only.

    A problem is an entry point whose name has no known `<kind>.` prefix (it is skipped).
    Cached for the process: `entry_point_plugins.cache_clear()` after changing `sys.path`.
    """
    if not may_register(GROUP):
        return (), ()
    from importlib.metadata import entry_points

    plugins: list[Plugin] = []
    problems: list[str] = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name, _origin(e))):
        kind, _, name = ep.name.partition(".")
        if kind not in KINDS or not name:
            problems.append(
                f"entry point {ep.name!r} = {ep.value!r} of {_origin(ep)}: the name must be '<kind>.<name>'"
                f" with kind one of {', '.join(KINDS)}; skipped"
            )
            continue
        plugins.append(Plugin(kind, name, ep.value, _origin(ep)))  # type: ignore[arg-type]
    return tuple(plugins), tuple(problems)


_METADATA_DIRS = (".dist-info", ".egg-info")
_UNREAD = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
"""What `importlib.metadata` takes for a distribution without the file (its `read_text` gives None)."""


def may_register(group: str) -> bool:
    """Whether an installed distribution may register an entry point in `group`: False only where
    `importlib.metadata.entry_points(group=group)` would find none.

    That scan parses the `entry_points.txt` of every `*.dist-info` / `*.egg-info` folder in every
    `sys.path` folder (and an egg's `EGG-INFO`) into entry point objects, and a file can hold the
    group only under a `[group]` line. Reading those files as bytes and looking for that line costs
    a fraction of the scan: `rollout validate` 1,122 -> 1,086 M instructions (-3.2%) in the dev
    venv, where no plugin is installed, the usual case. Anything not read as the scan would read it
    -- a zip file or a non-string entry on the path, another distribution finder on
    `sys.meta_path`, a file that can't be read -- is True, and the scan decides."""
    if any(hasattr(finder, "find_distributions") and finder is not importlib.machinery.PathFinder
           for finder in sys.meta_path):
        return True
    needle = f"[{group}]".encode()
    for entry in sys.path:
        if not isinstance(entry, (str, os.PathLike)):
            return True  # bytes or another object: left to the scan
        root = entry or "."
        try:
            children = os.listdir(root)
        except OSError:
            if os.path.exists(root):  # a zip file (or a folder it can't list)
                return True
            continue  # no such path: nothing there for the scan either
        for child in children:
            low = child.lower()
            if not (low.endswith(_METADATA_DIRS) or low == "egg-info"):
                continue
            try:
                with open(os.path.join(root, child, "entry_points.txt"), "rb") as f:
                    if needle in f.read():
                        return True
            except _UNREAD:
                continue
            except OSError:
                return True
    return False


def _origin(ep: EntryPoint) -> str:
    dist = ep.dist
    return "an unknown distribution" if dist is None else f"{dist.name}=={dist.version}"


def plugins_of(kind: PluginKind, builtins: Mapping[str, str] | None = None) -> list[Plugin]:
    """Every plugin of a kind: the built-ins (`rl/builtins.py`, or `builtins` given), then the
    installed ones, clashes included (see `clash_errors`)."""
    own = _BUILTINS.get(kind, {}) if builtins is None else builtins
    return [Plugin(kind, name, ref, BUILTIN) for name, ref in own.items()] + [
        p for p in entry_point_plugins()[0] if p.kind == kind
    ]


def clash_errors(plugins: list[Plugin]) -> dict[tuple[PluginKind, str], ConfigError]:
    """One error per (kind, name) registered more than once, naming every origin."""
    by_key: dict[tuple[PluginKind, str], list[Plugin]] = {}
    for plugin in plugins:
        by_key.setdefault((plugin.kind, plugin.name), []).append(plugin)
    return {
        key: ConfigError(
            f"plugin name clash: {_WHAT[key[0]]} {key[1]!r} is registered by "
            + " and by ".join(p.where for p in same)
            + "; uninstall one or refer to it by its 'module:attr'"
        )
        for key, same in by_key.items()
        if len(same) > 1
    }


def find_plugin(kind: PluginKind, name: str, builtins: Mapping[str, str] | None = None) -> Plugin | None:
    """The plugin of that kind and name, or None; a `ConfigError` naming both origins on a clash."""
    same = [p for p in plugins_of(kind, builtins) if p.name == name]
    if len(same) > 1:
        raise clash_errors(same)[(kind, name)]
    return same[0] if same else None


def plugin_names(kind: PluginKind, builtins: Mapping[str, str] | None = None) -> list[str]:
    """The names a config may use for this kind, built-ins first (for messages and `--help`)."""
    return list(dict.fromkeys(p.name for p in plugins_of(kind, builtins)))


def unknown_name_error(kind: PluginKind, name: str, *, builtin_noun: str = "") -> ConfigError:
    """The error for a name that is neither a plugin nor a 'module:attr' reference:
    "unknown env 'chess': expected a built-in env (arithmetic, ...), an installed plugin (...) or ..."."""
    builtins = ", ".join(sorted(_BUILTINS.get(kind, {})))
    installed = [p.name for p in entry_point_plugins()[0] if p.kind == kind]
    plugins = f", an installed plugin ({', '.join(dict.fromkeys(installed))})" if installed else ""
    return ConfigError(
        f"unknown {_WHAT[kind]} {name!r}: expected a built-in {builtin_noun}({builtins}){plugins} or a"
        " 'module:attr' reference"
    )
