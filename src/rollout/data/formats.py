"""Dataset line shapes: check one parsed line and turn it into the rows an algorithm trains on.

    rows, problem = normalize_line({"chosen": [...], "rejected": [...]}, "preference")
    # -> [{"prompt": [...shared messages], "chosen": [...], "rejected": [...]}], None

Every shape of TRL's dataset guide (https://huggingface.co/docs/trl/dataset_formats)
is accepted unchanged, in its standard (strings) and conversational (lists of
`{"role", "content"}` messages) forms:

| kind         | algorithms        | accepted lines                                          | rows               |
|--------------|-------------------|---------------------------------------------------------|--------------------|
| `sft`        | sft               | `{"messages"}`, `{"prompt", "completion"}`, `{"text"}`  | the line           |
| `preference` | rm, dpo           | `{"prompt", "chosen", "rejected"}`                      | the line           |
|              |                   | `{"chosen", "rejected"}` (implicit prompt)              | prompt extracted   |
| `kto`        | kto               | `{"prompt", "completion", "label": bool}`               | the line           |
|              |                   | any preference line (as TRL's KTOTrainer unpairs it)    | two: chosen→true, rejected→false |
| `prompt`     | grpo, ppo, eval   | `{"prompt", ...extra fields for the env / rewards}`     | the line           |

Implicit prompt, as TRL's `extract_prompt` (trl/data_utils.py) does it: the
prompt is the longest common prefix of `chosen` and `rejected` (characters of
strings, whole messages of conversations); when the strings first differ right
after a space, the space goes to the completions. When one is a prefix of the
other, TRL's loop leaves the split one element before the end of the shorter,
and so do we. As `maybe_extract_prompt`, a line whose `prompt` is a string but
whose `chosen`/`rejected` are conversations (UltraFeedback's shape: the prompt
repeated as a plain string) also has its prompt extracted. Where TRL would
quietly produce an empty prompt we report the line instead, and a conversation's
shared prefix must end right before an assistant turn, with both sides ending
in one. Fields other than the ones above are kept (a preference line's `margin`,
an RL line's `answer`).

A problem is one short sentence (`missing field "chosen"`); the readers
prefix it with the location (`data/pref.jsonl:17: ...`). No torch, numpy or
transformers here: `rollout validate` runs this on every line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

LineKind = Literal["sft", "preference", "kto", "prompt"]
LINE_KINDS: tuple[LineKind, ...] = ("sft", "preference", "kto", "prompt")

ROLES = ("system", "user", "assistant", "tool")

Normalized = tuple[list[dict], str | None]
"""(the rows of a valid line, None) or ([], its first problem)."""


def normalize_line(data: object, kind: LineKind) -> Normalized:
    """The internal rows of one parsed line (TRL shapes converted), or its first problem."""
    if not isinstance(data, dict):
        return [], f"expected a JSON object, got {json_type(data)}"
    return _NORMALIZERS[kind](data)


def check_line(data: object, kind: LineKind) -> str | None:
    """The first problem of one parsed line, or None when it is valid."""
    return normalize_line(data, kind)[1]


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple[str | list, str | list, str | list]:
    """(prompt, chosen, rejected) split as TRL's `extract_prompt` splits them (see the module doc).

    Both must already be non-empty, of the same shape and different; the
    prompt returned may be empty (the caller reports that).
    """
    n = min(len(chosen), len(rejected))
    split = n - 1  # TRL's loop variable when no element differs (one side is a prefix of the other)
    for i in range(n):
        if chosen[i] != rejected[i]:
            split = i
            if i > 0 and chosen[i - 1] == " ":  # TRL: "remove space before the prompt"
                split -= 1
            break
    return chosen[:split], chosen[split:], rejected[split:]


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


# --- per-kind normalizers -------------------------------------------------------


def _only(data: dict, problem: str | None) -> Normalized:
    return ([data], None) if problem is None else ([], problem)


def _normalize_sft(data: dict) -> Normalized:
    if "messages" in data:
        return _only(data, _check_messages(data["messages"], "messages", need_assistant=True) or _check_tools(data))
    if "prompt" in data or "completion" in data:
        return _only(data, _check_prompt_completion(data))
    if "text" in data:
        return _only(data, _check_string(data["text"], "text"))
    return [], 'missing field "messages" (sft lines need "messages", "prompt" + "completion", or "text")'


def _normalize_preference(data: dict) -> Normalized:
    for field in ("chosen", "rejected"):
        if field not in data:
            return [], f'missing field "{field}"'
    if _prompt_is_implicit(data):
        data, problem = _with_extracted_prompt(data)
        if problem:
            return [], problem
    return _only(data, _check_preference(data))


def _normalize_kto(data: dict) -> Normalized:
    if "label" not in data and "completion" not in data and "chosen" in data and "rejected" in data:
        rows, problem = _normalize_preference(data)
        if problem:
            return [], problem
        pair = rows[0]
        extra = {k: v for k, v in pair.items() if k not in ("prompt", "chosen", "rejected")}
        return [
            {"prompt": pair["prompt"], "completion": pair["chosen"], "label": True, **extra},
            {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False, **extra},
        ], None
    problem = _check_prompt_completion(data)
    if problem:
        return [], problem
    if "label" not in data:
        return [], 'missing field "label"'
    if not isinstance(data["label"], bool):
        return [], f'field "label" must be a boolean, got {json_type(data["label"])}'
    return [data], None


def _normalize_prompt(data: dict) -> Normalized:
    if "prompt" not in data:
        return [], 'missing field "prompt"'
    return _only(data, _check_text_or_messages(data["prompt"], "prompt", need_assistant=False))


_NORMALIZERS: dict[str, Callable[[dict], Normalized]] = {
    "sft": _normalize_sft,
    "preference": _normalize_preference,
    "kto": _normalize_kto,
    "prompt": _normalize_prompt,
}


# --- implicit prompt --------------------------------------------------------------


def _prompt_is_implicit(data: dict) -> bool:
    """No prompt, or (as TRL's `maybe_extract_prompt`) a string prompt beside conversations."""
    if "prompt" not in data:
        return True
    return isinstance(data["prompt"], str) and isinstance(data["chosen"], list) and isinstance(data["rejected"], list)


def _with_extracted_prompt(data: dict) -> tuple[dict, str | None]:
    problem = (
        _check_text_or_messages(data["chosen"], "chosen", need_assistant=True)
        or _check_text_or_messages(data["rejected"], "rejected", need_assistant=True)
        or _check_same_shape(data, ("chosen", "rejected"))
    )
    if problem:
        return data, problem
    chosen, rejected = data["chosen"], data["rejected"]
    if chosen == rejected:
        return data, "chosen and rejected are identical"
    prompt, chosen_rest, rejected_rest = extract_prompt(chosen, rejected)
    if not prompt:
        return data, 'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'
    if isinstance(chosen, list):
        problem = _check_conversation_split(prompt, chosen_rest, rejected_rest)
        if problem:
            return data, problem
    extra = {k: v for k, v in data.items() if k not in ("prompt", "chosen", "rejected")}
    return {"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest, **extra}, None


def _check_conversation_split(prompt: list, chosen: list, rejected: list) -> str | None:
    """The shared messages end right before an assistant turn, and both sides end with one."""
    at = len(prompt)
    for field, rest in (("chosen", chosen), ("rejected", rejected)):
        if rest[0]["role"] != "assistant":
            return (
                f"implicit prompt: chosen and rejected share messages 0..{at - 1}, but {field}[{at}]"
                f' is a "{rest[0]["role"]}" turn; the shared prefix must end right before an assistant turn'
            )
    for field, rest in (("chosen", chosen), ("rejected", rejected)):
        if rest[-1]["role"] != "assistant":
            return f'implicit prompt: the last message of "{field}" must be an assistant turn, got "{rest[-1]["role"]}"'
    return None


# --- field checks ---------------------------------------------------------------
# Each returns the first problem or None.


def _check_preference(data: dict) -> str | None:
    if "prompt" not in data:
        return 'missing field "prompt"'
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


def _check_tools(data: dict) -> str | None:
    """An optional "tools" field: the OpenAI tool schemas the chat template renders."""
    tools = data.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f'field "tools" must be a list of tool schemas (objects), got {json_type(tools)}'
    return None


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
        # One test for the usual message; the located problem is worked out only for a bad one
        # (`validate` runs this on every message of every line).
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            return _message_problem(message, f"{field}[{i}]")
        has_assistant = has_assistant or message["role"] == "assistant"
    if need_assistant and not has_assistant:
        return f'field "{field}" has no assistant message'
    return None


def _message_problem(message: object, where: str) -> str:
    """What is wrong with a message that failed `_check_messages`' test."""
    if not isinstance(message, dict):
        return f"{where} must be an object, got {json_type(message)}"
    for key in ("role", "content"):
        if key not in message:
            return f'{where}: missing field "{key}"'
    role = message["role"]
    if role not in ROLES:
        shown = json.dumps(role) if isinstance(role, str) else json_type(role)
        return f'{where}: field "role" must be one of {", ".join(ROLES)}, got {shown}'
    return f'{where}: field "content" must be a string, got {json_type(message["content"])}'
