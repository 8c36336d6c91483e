"""Resolve a `module:attr` reference from a config (SPEC section 11: in-process plugins).

load_ref("my_pkg.rewards:exact_match", what="reward function")   # the object, or ConfigError
"""

from __future__ import annotations

import importlib

from rollout.errors import ConfigError


def is_ref(name: str) -> bool:
    return ":" in name


def load_ref(ref: str, *, what: str) -> object:
    """Import `module` and return its (dotted) `attr`; a located `ConfigError` on any failure."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"bad {what} reference {ref!r}: expected 'module:attr', e.g. 'my_pkg.rewards:exact'"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"cannot import module {module_name!r} for {what} {ref!r}: {err}") from None
    except Exception as err:  # the module itself failed while importing: a user bug, report it located
        raise ConfigError(
            f"importing module {module_name!r} for {what} {ref!r} failed: {type(err).__name__}: {err}"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (for {what} {ref!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {ref!r} is not callable (got {type(obj).__name__})")
    return obj
