"""What every TOML config loader shares: the strict base model, paths resolved
against the config file's folder, and located error messages.

`format_validation_errors` turns a pydantic `ValidationError` into one
`file:line: dotted.locator: problem` string per violation, in a stable order;
`rollout.config` (the run config) and `rollout.inference.config` (the
`[inference]` table) both report through it. No torch here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, ValidationInfo

from rollout.errors import ConfigError


def _resolve_path(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base_dir")
    value = value.expanduser()
    if base is not None and not value.is_absolute():
        value = Path(base) / value
    return Path(value.resolve()) if value.is_absolute() else value


ConfigPath = Annotated[Path, AfterValidator(_resolve_path)]
"""A filesystem path; relative paths resolve against the config file's folder."""


def resolve_model_uri(value: str, info: ValidationInfo) -> str:
    """A local directory (resolved like a path) or a hub id like `org/name`."""
    base = (info.context or {}).get("base_dir")
    looks_local = value.startswith(("./", "../", "/", "~")) or value in (".", "..")
    if base is not None and not looks_local and (Path(base) / value).exists():
        looks_local = True
    if not looks_local:
        return value
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    return str(path.resolve())


class StrictModel(BaseModel):
    """Base for every config block: unknown keys are errors, values are immutable."""

    # defer_build: a block's own validator is built when it is first used alone, not at import.
    # `RunConfig` builds the whole tree into its validator anyway, so the ~80 classes' own
    # validators were built for nothing on every CLI start (validate: ~10 ms, 3%, measured
    # interleaved on a 2-core VM).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, defer_build=True)


@contextmanager
def pydantic_plugins_off() -> Iterator[None]:
    """Validators built inside the block load no pydantic plugin, as typer builds its own
    (`typer._adapters.disabled_pydantic_plugins`). pydantic looks for plugins when it builds its
    first validator in a process: an entry-point scan of every installed distribution (~2.4% of
    `rollout validate`'s instructions in the dev venv). `validate` builds only rollout's own config
    models, which no user's plugin has reason to watch; a validator built after the block looks
    for plugins as usual (pydantic caches no answer while they are off)."""
    before = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = before


# --------------------------------------------------------------------------- located errors


def format_validation_errors(
    err: ValidationError, data: Mapping[str, Any], *, text: str | None = None, source: Path | None = None
) -> list[str]:
    """One `file:line: dotted.locator: problem` string per violation, in a stable order."""
    found: set[tuple[int, str, str]] = set()
    for e in err.errors(include_url=False):
        keys = _locator_keys(e["loc"], data)
        locator = ".".join(keys) if keys else "<root>"
        line = _find_line(text, keys) if text else None
        if text and e["type"] == "union_tag_invalid":  # point at the `kind = ...` line itself
            line = _find_line(text, [*keys, str(e.get("ctx", {}).get("discriminator", "")).strip("'")]) or line
        found.add((line or 0, locator, _describe(e)))
    out = []
    for line, locator, problem in sorted(found):  # document order, then locator: deterministic
        where = "" if source is None else (f"{source}:{line}: " if line else f"{source}: ")
        out.append(f"{where}{locator}: {problem}")
    return out


def located_error(source: Path, keys: Sequence[str], problem: str) -> ConfigError:
    """One problem found after validation (e.g. at plan time), located like a validation error:
    `file:line: dotted.locator: problem` (without the line when the key is not in the file)."""
    try:
        text: str | None = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = None
    line = _find_line(text, keys) if text else None
    where = f"{source}:{line}: " if line else f"{source}: "
    return ConfigError(f"{where}{'.'.join(keys)}: {problem}")


def _locator_keys(loc: Sequence[int | str], data: Any) -> list[str]:
    """Map pydantic's loc to the user's keys, dropping discriminated-union tags.

    Pydantic inserts the union tag (e.g. 'adamw') into the loc; we walk the
    user's own data and keep only the segments that really are keys there.
    A tag comes first where it is also a key: `[algorithm]` with `kind = "sft"`
    has the loc `algorithm.sft.sft...` (the tag, then the `[algorithm.sft]` block).
    """
    keys: list[str] = []
    node = data
    tag_skipped_in: Any = None  # the mapping whose union tag was dropped (a tag appears once per mapping)
    for i, part in enumerate(loc):
        is_last = i == len(loc) - 1
        if isinstance(node, Mapping):
            if node is not tag_skipped_in and _is_union_tag(node, part):
                tag_skipped_in = node
                continue
            if part in node:
                keys.append(str(part))
                node = node[part]
                continue
            if "kind" not in node and not is_last and loc[i + 1] in node:
                continue  # the tag of a union member picked by default (a block without `kind`)
            if is_last or not isinstance(part, str) or _is_union_tag(node, part):
                if not _is_union_tag(node, part):
                    keys.append(str(part))
                continue
            keys.append(str(part))  # a missing block: name it and stop descending
            node = None
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            keys.append(str(part))
            node = node[part]
        elif isinstance(part, str) and node is not None and _is_union_tag(node, part):
            continue
        else:
            keys.append(str(part))
            node = None
    return keys


def _is_union_tag(node: Any, part: int | str) -> bool:
    return isinstance(node, Mapping) and node.get("kind") == part


def _describe(e: Mapping[str, Any]) -> str:
    kind = e["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "missing field"
    if kind == "union_tag_not_found":
        return 'missing field "kind"'
    if kind == "union_tag_invalid":
        ctx = e.get("ctx", {})
        return f"unknown kind {ctx.get('tag')!r} (expected one of {ctx.get('expected_tags')})"
    msg = str(e["msg"])
    msg = re.sub(r"^(Value error|Assertion failed), ", "", msg)
    msg = re.sub(r"^Input should be ", "must be ", msg)
    msg = msg[0].lower() + msg[1:] if msg else msg
    if kind not in ("value_error", "assertion_error") and not isinstance(e.get("input"), (dict, list)):
        msg += f" (got {e['input']!r})"
    return msg


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r'^\s*("?)([A-Za-z0-9_\-.]+)\1\s*=')


def _find_line(text: str, keys: Sequence[str]) -> int | None:
    """Best-effort line number of a locator in the TOML text (1-based)."""
    if not keys:
        return None
    lines = text.splitlines()
    table: list[str] = []
    best: tuple[int, int] | None = None  # (matched key count, line)
    for number, raw in enumerate(lines, start=1):
        header = _HEADER.match(raw)
        if header:
            table = [p.strip().strip('"') for p in header.group(1).split(".")]
            matched = _prefix_len(table, keys)
            if matched == len(table) and (best is None or matched > best[0]):
                best = (matched, number)
            continue
        key = _KEY.match(raw)
        if key:
            full = table + [p.strip().strip('"') for p in key.group(2).split(".")]
            matched = _prefix_len(full, keys)
            if matched == len(full) and (best is None or matched > best[0]):
                best = (matched, number)
    return best[1] if best else None


def _prefix_len(path: Sequence[str], keys: Sequence[str]) -> int:
    n = 0
    for a, b in zip(path, keys, strict=False):
        if a != b:
            break
        n += 1
    return n
