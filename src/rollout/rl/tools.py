"""Tool calling (SPEC section 9, Tools): tools from Python functions, Hermes/Qwen call parsing, execution.

    tools = {t.name: t for t in resolve_tools(["calculator", "my_pkg.tools:search"])}
    prompt = tokenizer.apply_chat_template(messages, tools=[t.openai_schema() for t in tools.values()])
    parsed = parse_tool_calls(assistant_text, turn=2)        # calls in order + the text around them
    results = await execute_tool_calls(parsed.calls, tools)  # one ToolResult per call, never raises
    messages += tool_messages(results)                       # {"role": "tool", "content": ...} each
    stats.record_episode(results)                            # -> tools/calls_per_episode, tools/error_rate

`resolve_tools` also takes installed plugins' names (`rollout.plugins`) and sidecar tables,
whose `describe` lists their tools and whose `tool.call` runs them (`rollout.sidecar`).

A tool is a sync or async Python function; its JSON schema comes from the type
hints (str, int, float, bool, list[T], dict[str, T], Literal[...], unions,
`X | None`; a default makes a parameter optional) and the Google-style
docstring (the first paragraph describes the tool, `Args:` the parameters),
in the shape `transformers.utils.get_json_schema` produces.

Calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(Hermes, Qwen2.5/3). Parsing is strict, so the model gets a clear error to
learn from rather than a guess: each block holds exactly one JSON object
(decoded with `raw_decode`, so "</tool_call>" inside a JSON string is fine),
and text between the object and `</tool_call>`, or a block with no closing
tag (a truncated message, or a sampler that cut "</tool_call>" as a stop
string: put it back first), is a `ToolCallError`. `arguments` may also be a
JSON string holding an object (some models do that); missing or null
arguments mean `{}`.

Everything the model can get wrong becomes a `ToolResult` whose `content`
("error: ...") goes back to the model and whose `error` names the category:
"bad_json" (the block is not a well-formed call), "unknown_tool",
"bad_arguments" (missing, unexpected or mistyped arguments, checked against
the schema), "tool_raised", "timeout". Sync tools run in a daemon thread each:
a timed-out sync tool can't be killed and keeps running in the background, but
it neither blocks the event loop nor interpreter exit. No torch here.

About 540 lines on purpose: the schema a tool advertises, the parser of the
model's calls and the argument check against that schema are one contract and
read together; the built-in calculator lives in `rl/calc.py`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout.errors import ConfigError
from rollout.inference.types import Message
from rollout.plugins import find_plugin, unknown_name_error
from rollout.rl.refs import is_ref, load_ref
from rollout.rl.rewards import _in_daemon_thread
from rollout.sidecar import Sidecar, SidecarError, call_sidecar_tool, tool_schemas
from rollout.sidecar_config import SidecarConfig

ToolErrorKind = Literal["unknown_tool", "bad_json", "bad_arguments", "tool_raised", "timeout"]
JsonSchema = dict[str, Any]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI tools API accepts


# --- tools and their schemas ---------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema of its keyword arguments."""

    name: str
    description: str
    parameters: JsonSchema
    """{"type": "object", "properties": {...}, "required": [...]}: what `execute_tool_calls` checks."""
    fn: Callable[..., Any]
    is_async: bool
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not _TOOL_NAME.match(self.name):
            raise ConfigError(f"bad tool name {self.name!r}: use 1-64 letters, digits, '_' or '-'")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        if self.parameters.get("type") != "object" or not isinstance(self.parameters.get("properties"), dict):
            raise ConfigError(
                f'tool {self.name!r}: parameters must be a {{"type": "object", "properties": ...}} schema'
            )

    def __call__(self, /, **arguments: Any) -> Any:
        """Call the function directly (so a `module:attr` reference can name a `Tool`)."""
        return self.fn(**arguments)

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI tools entry; transformers' `apply_chat_template(tools=[...])` accepts it too."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool_from_function(fn: Callable[..., Any], *, name: str | None = None, timeout_s: float = 10.0) -> Tool:
    """A `Tool` whose schema comes from `fn`'s type hints and docstring; `ConfigError` on what JSON can't express."""
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name:
        raise ConfigError(f"tool {fn!r} has no __name__: pass name=")
    try:
        signature = inspect.signature(fn, eval_str=True)
    except Exception as err:  # a string annotation naming something undefined, a builtin without a signature
        raise ConfigError(
            f"tool {tool_name!r}: cannot read its signature: {type(err).__name__}: {err}"
        ) from None
    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        where = f"tool {tool_name!r}, parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(
                f"{where}: *args, **kwargs and positional-only parameters can't be tool arguments"
            )
        if param.annotation is param.empty:
            raise ConfigError(f"{where}: needs a type annotation")
        schema = _schema_of(param.annotation, where)
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters: JsonSchema = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return Tool(tool_name, description, parameters, fn, _is_async(fn), timeout_s)


_SCALARS: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_TYPE_OF: dict[type, str] = {**_SCALARS, type(None): "null"}  # type: ignore[dict-item]


def _schema_of(hint: object, where: str) -> JsonSchema:
    """The JSON schema of one annotation (the subset `_check_value` validates)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:  # Annotated[int, ...]: the metadata is not part of the schema
        return _schema_of(args[0], where)
    if isinstance(hint, type) and hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is list or origin is list:
        return {"type": "array", "items": _schema_of(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise ConfigError(
                f"{where}: JSON object keys are strings, so use dict[str, T], not {_show(hint)}"
            )
        return {"type": "object", "additionalProperties": _schema_of(args[1], where)}
    if origin is Literal:
        if not args or any(type(a) not in _JSON_TYPE_OF for a in args):
            raise ConfigError(
                f"{where}: Literal values must be str, int, float, bool or None in {_show(hint)}"
            )
        json_types = list(dict.fromkeys(_JSON_TYPE_OF[type(a)] for a in args))
        return {"type": json_types[0] if len(json_types) == 1 else json_types, "enum": list(args)}
    if origin is typing.Union or origin is types.UnionType:
        options = [_schema_of(a, where) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    raise ConfigError(
        f"{where}: unsupported annotation {_show(hint)} (use str, int, float, bool, list[T], dict[str, T],"
        " Literal[...], unions of those, or X | None)"
    )


def _show(hint: object) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")  # "name (type): text" or "name: text"


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph as one line, {parameter: description} from a Google-style `Args:` section).

    `doc` is cleaned (`inspect.getdoc`): section headers are unindented.
    """
    lines = doc.splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        first.append(line.strip())
    arg_docs: dict[str, str] = {}
    in_args, current, arg_indent = False, "", 0
    for line in lines:
        if header := _SECTION.match(line):
            in_args, current = header.group(1) in ("Args", "Arguments", "Parameters"), ""
            continue
        if not in_args or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = _ARG_LINE.match(line.strip())
        if entry and (not current or indent <= arg_indent):
            current, arg_indent = entry.group(1), indent
            arg_docs[current] = entry.group(2).strip()
        elif current:  # a continuation line of the current argument
            arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return " ".join(first), arg_docs


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def resolve_tools(refs: Sequence[str | SidecarConfig]) -> list[Tool]:
    """Tools from built-in or plugin ids (`BUILTIN_TOOLS`, `rollout.plugins`), `module:attr`
    references (a function or a `Tool`), or sidecar tables (every tool the sidecar's `describe` lists)."""
    tools: list[Tool] = []
    origin: dict[str, str] = {}
    for ref in refs:
        if isinstance(ref, SidecarConfig):
            found, where = sidecar_tools(ref), ref.label
        else:
            found, where = [_tool_of(ref)], ref
        for tool in found:
            if tool.name in origin:
                raise ConfigError(f"two tools are named {tool.name!r}: {origin[tool.name]!r} and {where!r}")
            origin[tool.name] = where
            tools.append(tool)
    return tools


def _tool_of(ref: str) -> Tool:
    plugin = find_plugin("tool", ref)
    if plugin is not None:
        obj = plugin.load_callable()
        if isinstance(obj, Tool):
            return obj
        return tool_from_function(obj, name=ref)  # type: ignore[arg-type]
    if is_ref(ref):
        obj = load_ref(ref, what="tool")
        return obj if isinstance(obj, Tool) else tool_from_function(obj)  # type: ignore[arg-type]
    raise unknown_name_error("tool", ref, builtin_noun="tool ")


def sidecar_tools(cfg: SidecarConfig) -> list[Tool]:
    """The tools a sidecar lists in `describe` (asked now: a tool's schema is needed up front);
    each call is a `tool.call` to one shared process, started on the first call."""
    sidecar = Sidecar.from_config(cfg)
    try:
        info = sidecar.describe_blocking()
    except SidecarError as err:
        raise ConfigError(f"tools from {cfg.label}: {err}") from None
    if "tool" not in info["kinds"]:
        raise ConfigError(f"{sidecar.who} serves no tools: its describe lists kinds {info['kinds']}")
    # The sidecar's own timeout fires first (it restarts a hung process); this one only bounds a stuck start.
    timeout_s = 2 * cfg.timeout_s + 5.0
    return [
        Tool(schema.name, schema.description, schema.parameters, _sidecar_tool_fn(sidecar, schema.name), True,
             timeout_s)
        for schema in tool_schemas(info)
    ]


def _sidecar_tool_fn(sidecar: Sidecar, name: str) -> Callable[..., Any]:
    async def call(**arguments: Any) -> str:
        return await call_sidecar_tool(sidecar, name, arguments)

    call.__name__ = name
    return call


# --- parsing <tool_call> blocks ----------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")
_CLOSE_AFTER_WHITESPACE = re.compile(r"\s*" + re.escape(_CLOSE))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that is not a well-formed call; `raw` is the text inside the block."""

    id: str
    raw: str
    message: str
    name: str | None = None
    """The tool's name when the block got that far."""


@dataclass(frozen=True)
class ParsedToolCalls:
    calls: tuple[ToolCall | ToolCallError, ...]
    """In the order of the blocks in the text."""
    content: str
    """The text outside the blocks: each stretch stripped, joined by newlines."""


def parse_tool_calls(text: str, *, turn: int = 0) -> ParsedToolCalls:
    """Every `<tool_call>` block of an assistant message; call ids are `call_<turn>_<index>`."""
    calls: list[ToolCall | ToolCallError] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        call, pos = _parse_block(text, start + len(_OPEN), f"call_{turn}_{len(calls)}")
        calls.append(call)
    outside.append(text[pos:])
    return ParsedToolCalls(tuple(calls), "\n".join(part.strip() for part in outside if part.strip()))


def _parse_block(text: str, body: int, call_id: str) -> tuple[ToolCall | ToolCallError, int]:
    """(the call in the block whose body starts at `body`, where parsing goes on)."""
    start = _WHITESPACE.match(text, body).end()  # type: ignore[union-attr]
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as err:
        raw_end, resume, closed = _block_end(text, body)
        message = f"invalid JSON: {err.msg} at character {err.pos - start}" if closed else _UNTERMINATED
        return ToolCallError(call_id, text[body:raw_end].strip(), message), resume
    close = _CLOSE_AFTER_WHITESPACE.match(text, end)
    if close is not None:
        return _call_from_json(obj, call_id, text[body : close.start()].strip()), close.end()
    raw_end, resume, closed = _block_end(text, end)  # search after the object: a string may hold the tag
    name = obj.get("name") if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None
    if not closed:
        return ToolCallError(call_id, text[body:raw_end].strip(), _UNTERMINATED, name), resume
    junk = text[end:raw_end].strip()
    message = f"unexpected text after the JSON object: {junk[:40]!r} (one JSON object per <tool_call> block)"
    return ToolCallError(call_id, text[body:raw_end].strip(), message, name), resume


_UNTERMINATED = "unterminated tool call: <tool_call> without a closing </tool_call>"


def _block_end(text: str, pos: int) -> tuple[int, int, bool]:
    """(end of the block's text, where parsing resumes, whether `</tool_call>` closed it) from `pos` on."""
    close, reopen = text.find(_CLOSE, pos), text.find(_OPEN, pos)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close, close + len(_CLOSE), True
    end = reopen if reopen >= 0 else len(text)  # a new block opens first: this one was never closed
    return end, end, False


def _call_from_json(obj: object, call_id: str, raw: str) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(call_id, raw, f"a tool call must be a JSON object, got {_json_type(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        problem = 'missing "name"' if name is None else '"name" must be a non-empty string'
        return ToolCallError(call_id, raw, f'{problem} (expected {{"name": ..., "arguments": {{...}}}})')
    arguments = obj.get("arguments")
    if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else None
        except json.JSONDecodeError as err:
            return ToolCallError(call_id, raw, f'"arguments" is a string but not valid JSON: {err.msg}', name)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(
            call_id, raw, f'"arguments" must be a JSON object, got {_json_type(arguments)}', name
        )
    return ToolCall(call_id, name, arguments)


_JSON_NAMES = {
    type(None): "null",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def _json_type(value: object) -> str:
    return "boolean" if isinstance(value, bool) else _JSON_NAMES.get(type(value), type(value).__name__)


# --- executing calls ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    name: str
    """The called tool's name ("" when the block had none)."""
    content: str
    """What goes back to the model: the result, or "error: ..." when `error` is set."""
    error: ToolErrorKind | None = None


async def execute_tool_calls(
    calls: Sequence[ToolCall | ToolCallError],
    tools: Mapping[str, Tool],
    *,
    max_result_chars: int = 2000,
    concurrency: int = 8,
) -> list[ToolResult]:
    """Run the calls (at most `concurrency` at once); one result per call, in call order.

    Never raises for anything the model did: every failure is a result with
    `error` set. Contents over `max_result_chars` are cut, with a marker.
    """
    if concurrency < 1 or max_result_chars < 1:
        raise ValueError("concurrency and max_result_chars must be >= 1")
    slots = asyncio.Semaphore(concurrency)

    async def run(call: ToolCall | ToolCallError) -> ToolResult:
        async with slots:
            result = await _execute_one(call, tools)
        return _capped(result, max_result_chars)

    return list(await asyncio.gather(*(run(call) for call in calls)))


async def _execute_one(call: ToolCall | ToolCallError, tools: Mapping[str, Tool]) -> ToolResult:
    if isinstance(call, ToolCallError):
        text = f"error: could not parse the tool call: {call.message}"
        return ToolResult(call.id, call.name or "", text, "bad_json")
    tool = tools.get(call.name)
    if tool is None:
        text = f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}"
        return ToolResult(call.id, call.name, text, "unknown_tool")
    problems = check_arguments(call.arguments, tool.parameters)
    if problems:
        text = f"error: bad arguments for tool {tool.name!r}: {'; '.join(problems)}"
        return ToolResult(call.id, tool.name, text, "bad_arguments")
    timer = asyncio.timeout(tool.timeout_s)
    try:
        async with timer:
            if tool.is_async:
                value = await tool.fn(**call.arguments)
            else:
                value = await _in_daemon_thread(functools.partial(tool.fn, **call.arguments))
                if inspect.isawaitable(value):
                    value = await value
        content = value if isinstance(value, str) else _to_json(value)  # can raise: a circular structure
    except TimeoutError as err:
        if not timer.expired():  # the tool itself raised TimeoutError
            return _raised(call.id, tool.name, err)
        text = f"error: tool {tool.name!r} timed out after {tool.timeout_s:g}s"
        return ToolResult(call.id, tool.name, text, "timeout")
    except Exception as err:  # any failure of the tool's code goes back to the model as data
        return _raised(call.id, tool.name, err)
    return ToolResult(call.id, tool.name, content)


def _raised(call_id: str, name: str, err: Exception) -> ToolResult:
    return ToolResult(
        call_id, name, f"error: tool {name!r} raised {type(err).__name__}: {err}", "tool_raised"
    )


def _to_json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _capped(result: ToolResult, max_chars: int) -> ToolResult:
    extra = len(result.content) - max_chars
    if extra <= 0:
        return result
    content = f"{result.content[:max_chars]}…[truncated {extra} chars]"
    return ToolResult(result.call_id, result.name, content, result.error)


def check_arguments(arguments: Mapping[str, Any], parameters: JsonSchema) -> list[str]:
    """The problems of decoded JSON arguments against a tool's parameters schema (empty when they fit)."""
    properties: dict[str, JsonSchema] = parameters.get("properties", {})
    problems = [
        f"missing required argument {n!r}" for n in parameters.get("required", ()) if n not in arguments
    ]
    for arg, value in arguments.items():
        if arg not in properties:
            problems.append(f"unexpected argument {arg!r} (expected: {', '.join(properties) or 'none'})")
            continue
        problem = _check_value(value, properties[arg])
        if problem is not None:
            problems.append(f"argument {arg!r}: {problem}")
    return problems


_PY_TYPES: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check_value(value: object, schema: JsonSchema) -> str | None:
    """None when `value` fits `schema` (the subset `_schema_of` writes), else what is wrong."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(_check_value(value, option) is None for option in schema["anyOf"]):
            return None
        return f"expected {_describe(schema)}, got {_json_type(value)}"
    if "enum" in schema:
        if any(value == v and type(value) is type(v) for v in schema["enum"]):
            return None
        return f"expected one of {json.dumps(schema['enum'])}, got {json.dumps(value, default=str)}"
    kinds = schema.get("type")
    if kinds is None:
        return None
    if not any(_PY_TYPES[k](value) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return f"expected {_describe(schema)}, got {_json_type(value)}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            if (problem := _check_value(item, schema["items"])) is not None:
                return f"item {i}: {problem}"
    if isinstance(value, dict) and "additionalProperties" in schema:
        for key, item in value.items():
            if (problem := _check_value(item, schema["additionalProperties"])) is not None:
                return f"key {key!r}: {problem}"
    return None


def _describe(schema: JsonSchema) -> str:
    if "anyOf" in schema:
        text = " or ".join(_describe(option) for option in schema["anyOf"])
    else:
        kinds = schema.get("type", "any value")
        text = kinds if isinstance(kinds, str) else " or ".join(kinds)
        if kinds == "array" and "items" in schema:
            text = f"array of {_describe(schema['items'])}"
    return f"{text} or null" if schema.get("nullable") else text


def tool_messages(results: Iterable[ToolResult]) -> list[Message]:
    """One chat message per result, in order: role "tool" (Qwen2.5's template wraps each in <tool_response>)."""
    return [
        {"role": "tool", "content": r.content, "tool_call_id": r.call_id, "name": r.name} for r in results
    ]


# --- metrics ----------------------------------------------------------------------------------


@dataclass
class ToolStats:
    """Tool use over many episodes: `record_episode` each, then `metrics()`."""

    episodes: int = 0
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Failed calls by category ("timeout", "bad_json", ...)."""

    def record_episode(self, results: Iterable[ToolResult]) -> None:
        """Count one finished episode and every tool result of it (all its turns)."""
        self.episodes += 1
        for result in results:
            self.calls += 1
            if result.error is not None:
                self.errors[result.error] = self.errors.get(result.error, 0) + 1

    def metrics(self) -> dict[str, float]:
        """`tools/calls`, `tools/errors/<category>`, and the means where they are defined."""
        out = {"tools/calls": float(self.calls)}
        out.update({f"tools/errors/{kind}": float(n) for kind, n in sorted(self.errors.items())})
        if self.episodes:
            out["tools/calls_per_episode"] = self.calls / self.episodes
        if self.calls:
            out["tools/error_rate"] = sum(self.errors.values()) / self.calls
        return out
