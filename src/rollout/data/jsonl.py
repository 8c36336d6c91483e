"""Read JSONL datasets and check every line's schema (SPEC section 4).

    rows, report = read_rows(Path("data/sft.jsonl"), "sft")              # DataError on any bad line
    rows, report = read_rows(path, "preference", on_bad_line="skip")    # keep the valid lines
    report = scan_dataset(path, "sft")                                  # same checks, keeps no rows

A bad line is reported as `{path}:{line}: {problem}`, e.g.
`data/sft.jsonl:17: missing field "chosen"`. The file is streamed once; with
`on_bad_line="error"` the whole file is still scanned so the error can say how
many lines are bad. Blank (whitespace-only) lines are ignored everywhere: they
are neither rows nor bad lines, but they keep their place in the line count.

This module runs inside `rollout validate`, so it imports no torch,
transformers or numpy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollout.errors import DataError

LineKind = Literal["sft", "preference", "kto", "prompt"]
OnBadLine = Literal["error", "skip"]

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED_ERRORS = 20


@dataclass(frozen=True)
class Row:
    """One valid line: its 1-based line number in the file and the parsed object."""

    line: int
    data: dict


@dataclass(frozen=True)
class DataReport:
    """What a scan found. `num_lines` counts non-blank lines (= num_valid + num_skipped).

    `num_skipped` is the number of bad lines (skipped under `on_bad_line="skip"`);
    `errors` holds the first 20 located messages.
    """

    path: Path
    num_lines: int
    num_valid: int
    num_skipped: int
    errors: tuple[str, ...]


def read_rows(
    path: Path, kind: LineKind, *, on_bad_line: OnBadLine = "error"
) -> tuple[list[Row], DataReport]:
    """Parse and check every line of a JSONL file; return the valid rows and a report.

    Raises `DataError` when the file is missing, has no valid line, or (with
    `on_bad_line="error"`) has any bad line: the message is the first bad line's
    located problem, `details` list the next ones (at most 20) and a count of the rest.
    """
    rows: list[Row] = []
    report = _scan(Path(path), kind, on_bad_line, rows.append)
    return rows, report


def scan_dataset(path: Path, kind: LineKind, *, on_bad_line: OnBadLine = "error") -> DataReport:
    """The checks of `read_rows` without keeping the rows (for `validate` / `plan`)."""
    return _scan(Path(path), kind, on_bad_line, None)


def check_line(data: object, kind: LineKind) -> str | None:
    """The first schema problem of one parsed line, or None when it is valid."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {json_type(data)}"
    return _CHECKS[kind](data)


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type (bool before int: bool is an int in Python)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# --- scanning -------------------------------------------------------------------


def _scan(
    path: Path, kind: LineKind, on_bad_line: OnBadLine, keep: Callable[[Row], None] | None
) -> DataReport:
    if kind not in _CHECKS:
        raise ValueError(f"unknown line kind {kind!r}: expected one of {', '.join(_CHECKS)}")
    if on_bad_line not in ("error", "skip"):
        raise ValueError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
    if not path.is_file():
        raise DataError(f"dataset not found: {path}")

    num_lines = num_valid = num_bad = 0
    errors: list[str] = []
    for line_no, raw in _iter_lines(path):
        num_lines += 1
        data, problem = _parse_line(raw)
        if problem is None:
            problem = check_line(data, kind)
        if problem is not None:
            num_bad += 1
            if len(errors) <= MAX_REPORTED_ERRORS:  # the first one + 20 further ones for DataError.details
                errors.append(f"{path}:{line_no}: {problem}")
            continue
        num_valid += 1
        if keep is not None:
            assert isinstance(data, dict)
            keep(Row(line=line_no, data=data))

    if num_bad and on_bad_line == "error":
        further = errors[1:]
        details = list(further)
        if num_bad - 1 > len(further):
            details.append(f"... and {num_bad - 1 - len(further)} more bad lines")
        raise DataError(errors[0], details=details)
    if num_valid == 0:
        why = (
            f"no valid lines ({num_bad} bad lines skipped)"
            if num_bad
            else "no data lines (the file is empty)"
        )
        raise DataError(f"{path}: {why}", details=errors[:MAX_REPORTED_ERRORS])
    return DataReport(
        path=path,
        num_lines=num_lines,
        num_valid=num_valid,
        num_skipped=num_bad,
        errors=tuple(errors[:MAX_REPORTED_ERRORS]),
    )


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of every non-blank line, streamed."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():
                yield line_no, raw


def _parse_line(raw: bytes) -> tuple[object, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "invalid JSON: nested too deeply"


# --- per-kind checks ------------------------------------------------------------
# Each returns the first problem of a line (a dict) or None.


def _check_sft(data: dict) -> str | None:
    if "messages" in data:
        return _check_messages(data["messages"], "messages", need_assistant=True) or _check_tools(data)
    if "prompt" in data or "completion" in data:
        return _check_prompt_completion(data)
    if "text" in data:
        return _check_string(data["text"], "text")
    return 'missing field "messages" (sft lines need "messages", "prompt" + "completion", or "text")'


def _check_tools(data: dict) -> str | None:
    """An optional "tools" field: the OpenAI tool schemas the chat template renders."""
    tools = data.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f'field "tools" must be a list of tool schemas (objects), got {json_type(tools)}'
    return None


def _check_preference(data: dict) -> str | None:
    for field in ("prompt", "chosen", "rejected"):
        if field not in data:
            return f'missing field "{field}"'
    problem = (
        _check_text_or_messages(data["prompt"], "prompt", need_assistant=False)
        or _check_text_or_messages(data["chosen"], "chosen", need_assistant=True)
        or _check_text_or_messages(data["rejected"], "rejected", need_assistant=True)
        or _check_same_shape(data, ("prompt", "chosen", "rejected"))
    )
    if problem:
        return problem
    if data["chosen"] == data["rejected"]:
        return "chosen and rejected are identical"
    return None


def _check_kto(data: dict) -> str | None:
    problem = _check_prompt_completion(data)
    if problem:
        return problem
    if "label" not in data:
        return 'missing field "label"'
    if not isinstance(data["label"], bool):
        return f'field "label" must be a boolean, got {json_type(data["label"])}'
    return None


def _check_prompt(data: dict) -> str | None:
    if "prompt" not in data:
        return 'missing field "prompt"'
    return _check_text_or_messages(data["prompt"], "prompt", need_assistant=False)


_CHECKS: dict[str, Callable[[dict], str | None]] = {
    "sft": _check_sft,
    "preference": _check_preference,
    "kto": _check_kto,
    "prompt": _check_prompt,
}


def _check_prompt_completion(data: dict) -> str | None:
    for field in ("prompt", "completion"):
        if field not in data:
            return f'missing field "{field}"'
    return (
        _check_text_or_messages(data["prompt"], "prompt", need_assistant=False)
        or _check_text_or_messages(data["completion"], "completion", need_assistant=True)
        or _check_same_shape(data, ("prompt", "completion"))
    )


def _check_same_shape(data: dict, fields: tuple[str, ...]) -> str | None:
    """Strings are concatenated and message lists go through the chat template: no mixing."""
    if len({isinstance(data[f], str) for f in fields}) > 1:
        names = ", ".join(f'"{f}"' for f in fields[:-1]) + f' and "{fields[-1]}"'
        return f"fields {names} must all be strings or all be lists of messages"
    return None


def _check_string(value: object, field: str) -> str | None:
    if not isinstance(value, str):
        return f'field "{field}" must be a string, got {json_type(value)}'
    if not value:
        return f'field "{field}" must not be empty'
    return None


def _check_text_or_messages(value: object, field: str, *, need_assistant: bool) -> str | None:
    if isinstance(value, str):
        return None if value else f'field "{field}" must not be empty'
    if isinstance(value, list):
        return _check_messages(value, field, need_assistant=need_assistant)
    return f'field "{field}" must be a string or a list of messages, got {json_type(value)}'


def _check_messages(value: object, field: str, *, need_assistant: bool) -> str | None:
    if not isinstance(value, list):
        return f'field "{field}" must be a list of messages, got {json_type(value)}'
    if not value:
        return f'field "{field}" must not be empty'
    has_assistant = False
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            return f"{where} must be an object, got {json_type(message)}"
        for key in ("role", "content"):
            if key not in message:
                return f'{where}: missing field "{key}"'
        role = message["role"]
        if role not in ROLES:
            shown = json.dumps(role) if isinstance(role, str) else json_type(role)
            return f'{where}: field "role" must be one of {", ".join(ROLES)}, got {shown}'
        if not isinstance(message["content"], str):
            return f'{where}: field "content" must be a string, got {json_type(message["content"])}'
        has_assistant = has_assistant or role == "assistant"
    if need_assistant and not has_assistant:
        return f'field "{field}" has no assistant message'
    return None
