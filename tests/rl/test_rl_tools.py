"""Tools: schemas from hints and docstrings, the calculator, <tool_call> parsing, execution, stats."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Annotated, Literal, Optional

import pytest

from rollout.errors import ConfigError
from rollout.rl.builtins import BUILTIN_TOOLS
from rollout.rl.calc import calculator
from rollout.rl.tools import (
    ParsedToolCalls,
    Tool,
    ToolCall,
    ToolCallError,
    ToolResult,
    ToolStats,
    check_arguments,
    execute_tool_calls,
    parse_tool_calls,
    resolve_tools,
    tool_from_function,
    tool_messages,
)

# --- schemas ---------------------------------------------------------------------------------------


def search(query: str, limit: int = 5, exact: bool = False, lang: Optional[str] = None) -> list[str]:  # noqa: UP045
    """Search the web for a query.

    Returns at most `limit` titles.

    Args:
        query: What to look for. It can span
            two lines.
        limit (int): How many results.
        exact: Match the phrase exactly.

    Returns:
        The titles.
    """
    return [query] * limit


def plot(
    xs: list[float],
    labels: dict[str, int],
    style: Literal["line", "bar"] = "line",
    tags: list[str] | None = None,
    size: int | str = 3,
    scale: Annotated[float, "metres"] = 1.0,
) -> str:
    """Plot some points."""
    return "ok"


def test_schema_from_hints_and_docstring() -> None:
    tool = tool_from_function(search)
    assert tool.name == "search" and not tool.is_async and tool.timeout_s == 10.0
    assert tool.description == "Search the web for a query."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for. It can span two lines."},
            "limit": {"type": "integer", "description": "How many results."},
            "exact": {"type": "boolean", "description": "Match the phrase exactly."},
            "lang": {"type": "string", "nullable": True},
        },
        "required": ["query"],
    }
    assert tool.openai_schema() == {
        "type": "function",
        "function": {"name": "search", "description": tool.description, "parameters": tool.parameters},
    }


def test_schema_of_containers_literals_and_unions() -> None:
    tool = tool_from_function(plot, name="plotter", timeout_s=2.0)
    assert (tool.name, tool.timeout_s) == ("plotter", 2.0)
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "number"}},
            "labels": {"type": "object", "additionalProperties": {"type": "integer"}},
            "style": {"type": "string", "enum": ["line", "bar"]},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
            "size": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "scale": {"type": "number"},
        },
        "required": ["xs", "labels"],
    }


def test_schema_matches_transformers_get_json_schema() -> None:
    from transformers.utils import get_json_schema

    def described(
        query: str,
        k: int,
        ratio: float,
        flag: bool,
        ids: list[int],
        mode: Literal["a", "b"],
        note: str | None,
    ) -> str:
        """Do a thing.

        Args:
            query: The query.
            k: How many.
            ratio: A ratio.
            flag: A flag.
            ids: Some ids.
            mode: The mode.
            note: A note.
        """
        return query

    theirs = get_json_schema(described)["function"]
    ours = tool_from_function(described).openai_schema()["function"]
    assert ours["description"] == theirs["description"]
    assert ours["parameters"] == theirs["parameters"]


async def _async_tool(x: int) -> int:
    return x


def test_async_detection_and_method_tools() -> None:
    class Counter:
        def add(self, n: int) -> int:
            """Add n."""
            return n

    assert tool_from_function(_async_tool).is_async
    tool = tool_from_function(Counter().add)
    assert tool.parameters["properties"] == {"n": {"type": "integer"}} and tool.description == "Add n."


class Point:
    pass


def _no_hint(x) -> str:  # type: ignore[no-untyped-def]
    return ""


def _custom(p: Point) -> str:
    return ""


def _tuple(pair: tuple[int, int]) -> str:
    return ""


def _int_keys(table: dict[int, str]) -> str:
    return ""


def _star(*values: int) -> str:
    return ""


def _kwargs(**options: str) -> str:
    return ""


@pytest.mark.parametrize(
    ("fn", "param", "match"),
    [
        (_no_hint, "x", "needs a type annotation"),
        (_custom, "p", "unsupported annotation Point"),
        (_tuple, "pair", r"unsupported annotation tuple\[int, int\]"),
        (_int_keys, "table", r"use dict\[str, T\]"),
        (_star, "values", r"\*args"),
        (_kwargs, "options", r"\*\*kwargs"),
    ],
)
def test_unsupported_annotations(fn, param: str, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"tool '{fn.__name__}', parameter '{param}': .*{match}"):
        tool_from_function(fn)


def test_bad_tool_definitions() -> None:
    with pytest.raises(ConfigError, match="bad tool name"):
        tool_from_function(search, name="web search")
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        tool_from_function(search, timeout_s=0)
    with pytest.raises(ConfigError, match="parameters must be"):
        Tool("t", "", {"type": "string"}, search, False)


# --- the calculator --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("2+3", "5"),
        (" (12 + 7) * 3 / 2 ", "28.5"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("0.1 + 0.2", "0.3"),
        ("2**10", "1024"),
        ("-3**2", "-9"),
        ("(-3)**2", "9"),
        ("(-2)**3.0", "-8"),
        ("2**-2", "0.25"),
        ("4**0.5", "2"),
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("7 % 3", "1"),
        ("7.5 % 2", "1.5"),
        ("1/3", "0.3333333333333333"),
        ("1_000 * 3", "3000"),
        ("1.5e3", "1500"),
        ("--4", "4"),
        ("123456789 * 987654321", "121932631112635269"),
        ("10**99", "1" + "0" * 99),
        ("(1/3)**5000", "0"),
        ("-" * 199 + "1", "-1"),
        ("+".join(["1"] * 200), "200"),
    ],
)
def test_calculator(expression: str, result: str) -> None:
    assert calculator(expression) == result


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).__class__", "attribute access is not allowed"),
        ("x + 1", "unknown name 'x'"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("[1, 2]", "unsupported syntax: List"),
        ("1 if 2 else 3", "unsupported syntax: IfExp"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("9**9**9", "exponent too large"),
        ("2**400", "result too large"),
        ("10**99 * 10**99", "result too large"),
        ("1e999", "number too large"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**(1/3)", "not a real number"),
        ("", "invalid expression"),
        ("1 +", "invalid expression"),
        ("1; 2", "invalid expression"),
        ("1" + "+1" * 600, "expression too long"),
        ("(" * 300 + "1" + ")" * 300, "invalid expression: too many nested parentheses"),
        ("-" * 999 + "1", "nested too deeply"),
    ],
)
def test_calculator_rejects(expression: str, match: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        calculator(expression)
    assert time.perf_counter() - started < 0.5  # refused before computing anything big


# --- resolution ------------------------------------------------------------------------------------


def test_resolve_tools() -> None:
    calc, count, shout = resolve_tools(["calculator", "rl_tool_plugins:word_count", "rl_tool_plugins:shout"])
    assert calc.name == "calculator" and calc.fn is calculator and BUILTIN_TOOLS["calculator"] == "rollout.rl.calc:calculator"
    assert calc.parameters["required"] == ["expression"] and calc.description.startswith("Evaluate")
    assert count.name == "word_count" and count.description == "Count the words of a text."
    assert (shout.name, shout.timeout_s) == ("shout", 1.5)
    assert resolve_tools([]) == []


def test_resolve_tools_errors() -> None:
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        resolve_tools(["calculator", "rl_tool_plugins:calculator"])
    with pytest.raises(ConfigError, match="unknown tool 'search'"):
        resolve_tools(["search"])
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        resolve_tools(["rl_tool_plugins:nope"])
    with pytest.raises(ConfigError, match="tool 'untyped', parameter 'x'"):
        resolve_tools(["rl_tool_plugins:untyped"])


# --- parsing ---------------------------------------------------------------------------------------


def block(payload: object) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>\n{text}\n</tool_call>"


CALC_2_3 = {"name": "calculator", "arguments": {"expression": "2+3"}}


def test_parse_single_call() -> None:
    parsed = parse_tool_calls(block(CALC_2_3))
    assert parsed == ParsedToolCalls((ToolCall("call_0_0", "calculator", {"expression": "2+3"}),), "")


def test_parse_several_calls_with_text_around() -> None:
    text = (
        f"Let me compute.\n{block(CALC_2_3)}\n{block({'name': 'shout', 'arguments': {'text': 'hi'}})}\nDone."
    )
    parsed = parse_tool_calls(text, turn=3)
    assert [(c.id, c.name) for c in parsed.calls] == [("call_3_0", "calculator"), ("call_3_1", "shout")]
    assert parsed.content == "Let me compute.\nDone."
    assert parse_tool_calls("no calls here ") == ParsedToolCalls((), "no calls here")


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>',
        '<tool_call>  \r\n\t{"name": "calculator",\n "arguments": {\n  "expression": "2+3"\n }\n}\n\n </tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+3\\"}"}\n</tool_call>',
        '<tool_call>{"arguments": {"expression": "2+3"}, "name": "calculator", "id": 7}</tool_call>',
    ],
    ids=["compact", "odd-whitespace", "arguments-as-string", "extra-keys"],
)
def test_parse_variations(text: str) -> None:
    assert parse_tool_calls(text).calls == (ToolCall("call_0_0", "calculator", {"expression": "2+3"}),)


def test_parse_missing_or_null_arguments() -> None:
    for payload in ({"name": "now"}, {"name": "now", "arguments": None}, {"name": "now", "arguments": ""}):
        assert parse_tool_calls(block(payload)).calls == (ToolCall("call_0_0", "now", {}),)


def test_parse_closing_tag_inside_a_json_string() -> None:
    payload = {"name": "shout", "arguments": {"text": "a </tool_call> b <tool_call> c"}}
    parsed = parse_tool_calls(f"x {block(payload)} y")
    assert parsed.calls == (ToolCall("call_0_0", "shout", payload["arguments"]),)
    assert parsed.content == "x\ny"


def error_of(text: str) -> ToolCallError:
    (call,) = parse_tool_calls(text).calls
    assert isinstance(call, ToolCallError), call
    return call


def test_parse_truncated_message() -> None:
    err = error_of('Sure.\n<tool_call>\n{"name": "calculator", "argu')
    assert err.message.startswith("unterminated tool call") and err.raw == '{"name": "calculator", "argu'
    err = error_of(f"<tool_call>\n{json.dumps(CALC_2_3)}\n")  # a complete object, but no closing tag
    assert err.message.startswith("unterminated tool call") and err.name == "calculator"
    assert error_of("<tool_call>").message.startswith("unterminated tool call")


def test_parse_unterminated_block_before_another() -> None:
    parsed = parse_tool_calls(f'<tool_call>{{"name": "calc\n{block(CALC_2_3)}')
    first, second = parsed.calls
    assert isinstance(first, ToolCallError) and first.message.startswith("unterminated")
    assert second == ToolCall("call_0_1", "calculator", {"expression": "2+3"})


@pytest.mark.parametrize(
    ("payload", "match", "name"),
    [
        ('{"name": calculator}', "invalid JSON: Expecting value", None),
        (
            '{"name": "calculator", "arguments": {"expression": "2+3"}}}',
            "unexpected text after",
            "calculator",
        ),
        (
            '{"name": "calculator"} and more',
            "unexpected text after the JSON object: 'and more'",
            "calculator",
        ),
        ("[1, 2]", "must be a JSON object, got array", None),
        ('{"arguments": {}}', 'missing "name"', None),
        ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string', None),
        (
            '{"name": "calculator", "arguments": [1]}',
            '"arguments" must be a JSON object, got array',
            "calculator",
        ),
        (
            '{"name": "calculator", "arguments": "2+3"}',
            '"arguments" is a string but not valid JSON',
            "calculator",
        ),
        ('{"name": "calculator", "arguments": "[1]"}', '"arguments" must be a JSON object', "calculator"),
        ('{"name": "calculator", "arguments": 5}', "got integer", "calculator"),
    ],
)
def test_parse_errors(payload: str, match: str, name: str | None) -> None:
    parsed = parse_tool_calls(f"before {block(payload)} after {block(CALC_2_3)}")
    err, ok = parsed.calls
    assert isinstance(err, ToolCallError) and match in err.message and err.name == name
    assert err.id == "call_0_0" and err.raw == payload
    # One bad block spoils nothing else.
    assert ok == ToolCall("call_0_1", "calculator", {"expression": "2+3"})
    assert parsed.content == "before\nafter"


# --- execution -------------------------------------------------------------------------------------


def run(calls, tools, **kwargs) -> list[ToolResult]:
    return asyncio.run(execute_tool_calls(calls, tools, **kwargs))


def echo(
    text: str, times: int = 1, mode: Literal["plain", "loud"] = "plain", tags: list[str] | None = None
) -> str:
    """Echo a text."""
    return text * times


def fails(reason: str) -> str:
    raise RuntimeError(f"cannot do {reason}")


def raises_timeout() -> str:
    raise TimeoutError("upstream timed out")


def structured(n: int) -> object:
    if n == -2:
        loop: list[object] = []
        loop.append(loop)
        return loop
    return {"n": n, "squares": [i * i for i in range(n)]} if n >= 0 else object()


TOOLS = {
    t.name: t for t in (tool_from_function(f) for f in (calculator, echo, fails, raises_timeout, structured))
}


def test_execute_ok_and_result_encoding() -> None:
    calls = [
        ToolCall("c0", "calculator", {"expression": "2+3"}),
        ToolCall("c1", "echo", {"text": "ab", "times": 2, "mode": "loud", "tags": None}),
        ToolCall("c2", "structured", {"n": 3}),
        ToolCall("c3", "structured", {"n": -1}),
        ToolCall("c4", "structured", {"n": -2}),
    ]
    c0, c1, c2, c3, c4 = run(calls, TOOLS)
    assert c0 == ToolResult("c0", "calculator", "5", None)
    assert c1 == ToolResult("c1", "echo", "abab", None)
    assert c2.content == '{"n": 3, "squares": [0, 1, 4]}' and c2.error is None
    assert c3.content.startswith('"<object object at') and c3.error is None  # not JSON-able: str() of it
    assert c4 == ToolResult(
        "c4",
        "structured",
        "error: tool 'structured' raised ValueError: Circular reference detected",
        "tool_raised",
    )
    assert run([], TOOLS) == []


def test_execute_passes_any_argument_name() -> None:
    def apply(fn: str, self: int) -> str:
        return f"{fn}:{self}"

    (result,) = run([ToolCall("c0", "apply", {"fn": "f", "self": 1})], {"apply": tool_from_function(apply)})
    assert result == ToolResult("c0", "apply", "f:1", None)


def test_execute_errors_go_back_as_content() -> None:
    calls = [
        ToolCall("c0", "search", {"query": "x"}),
        ToolCallError("c1", "{bad", "invalid JSON: Expecting value at character 1"),
        ToolCall("c2", "fails", {"reason": "that"}),
        ToolCall("c3", "calculator", {"expression": "1/0"}),
        ToolCall("c4", "raises_timeout", {}),
    ]
    c0, c1, c2, c3, c4 = run(calls, TOOLS)
    assert c0.error == "unknown_tool"
    assert c0.content == (
        "error: unknown tool 'search'; available: calculator, echo, fails, raises_timeout, structured"
    )
    assert (c1.error, c1.name) == ("bad_json", "")
    assert c1.content == "error: could not parse the tool call: invalid JSON: Expecting value at character 1"
    assert c2 == ToolResult(
        "c2", "fails", "error: tool 'fails' raised RuntimeError: cannot do that", "tool_raised"
    )
    assert c3.content == "error: tool 'calculator' raised ValueError: division by zero"
    assert c4.error == "tool_raised" and "TimeoutError: upstream timed out" in c4.content


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "missing required argument 'text'"),
        ({"text": "a", "loud": True}, "unexpected argument 'loud' (expected: text, times, mode, tags)"),
        ({"text": 3}, "argument 'text': expected string, got integer"),
        ({"text": None}, "argument 'text': expected string, got null"),
        ({"text": "a", "times": True}, "argument 'times': expected integer, got boolean"),
        ({"text": "a", "times": 2.0}, "argument 'times': expected integer, got number"),
        ({"text": "a", "mode": "quiet"}, 'argument \'mode\': expected one of ["plain", "loud"], got "quiet"'),
        ({"text": "a", "tags": ["x", 1]}, "argument 'tags': item 1: expected string, got integer"),
        ({"text": "a", "tags": "x"}, "argument 'tags': expected array of string or null, got string"),
    ],
)
def test_execute_bad_arguments(arguments: dict, problem: str) -> None:
    (result,) = run([ToolCall("c0", "echo", arguments)], TOOLS)
    assert result.error == "bad_arguments"
    assert result.content == f"error: bad arguments for tool 'echo': {problem}"


def test_check_arguments() -> None:
    schema = tool_from_function(plot).parameters
    assert check_arguments({"xs": [1, 2.5], "labels": {"a": 1}, "size": "big", "scale": 2}, schema) == []
    assert check_arguments({"xs": [1], "labels": {"a": "1"}, "size": 1.5}, schema) == [
        "argument 'labels': key 'a': expected integer, got string",
        "argument 'size': expected integer or string, got number",
    ]
    assert check_arguments({}, schema) == [
        "missing required argument 'xs'",
        "missing required argument 'labels'",
    ]


def test_execute_timeouts() -> None:
    release = threading.Event()

    def slow_sync() -> str:
        release.wait(10)
        return "late"

    async def slow_async() -> str:
        await asyncio.sleep(10)
        return "late"

    tools = {
        "slow_sync": tool_from_function(slow_sync, timeout_s=0.2),
        "slow_async": tool_from_function(slow_async, timeout_s=0.2),
    }
    started = time.perf_counter()
    try:
        results = run([ToolCall("a", "slow_sync", {}), ToolCall("b", "slow_async", {})], tools)
    finally:
        release.set()  # let the abandoned thread finish
    assert time.perf_counter() - started < 2.0
    assert [(r.error, r.content) for r in results] == [
        ("timeout", "error: tool 'slow_sync' timed out after 0.2s"),
        ("timeout", "error: tool 'slow_async' timed out after 0.2s"),
    ]


def test_execute_async_tools_with_bounded_concurrency_in_order() -> None:
    running = peak = 0

    async def wait(ms: int) -> str:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(ms / 1000)
        running -= 1
        return f"waited {ms}"

    tools = {"wait": tool_from_function(wait)}
    delays = [60, 10, 40, 0, 30, 20]
    results = run(
        [ToolCall(f"c{i}", "wait", {"ms": ms}) for i, ms in enumerate(delays)], tools, concurrency=2
    )
    assert [r.call_id for r in results] == [f"c{i}" for i in range(len(delays))]
    assert [r.content for r in results] == [f"waited {ms}" for ms in delays]
    assert peak == 2


def test_execute_caps_long_results() -> None:
    (short, long, error) = run(
        [
            ToolCall("a", "echo", {"text": "x", "times": 100}),
            ToolCall("b", "echo", {"text": "x", "times": 5000}),
            ToolCall("c", "fails", {"reason": "y" * 500}),
        ],
        TOOLS,
        max_result_chars=100,
    )
    assert short.content == "x" * 100
    assert long.content == "x" * 100 + "…[truncated 4900 chars]"
    assert error.error == "tool_raised" and error.content.endswith("…[truncated 451 chars]")


def test_tool_messages() -> None:
    results = [ToolResult("call_1_0", "calculator", "5"), ToolResult("call_1_1", "", "error: x", "bad_json")]
    assert tool_messages(results) == [
        {"role": "tool", "content": "5", "tool_call_id": "call_1_0", "name": "calculator"},
        {"role": "tool", "content": "error: x", "tool_call_id": "call_1_1", "name": ""},
    ]


def test_parse_then_execute_round_trip() -> None:
    text = f"Computing. {block(CALC_2_3)} {block('{oops}')} {block({'name': 'nope', 'arguments': {}})}"
    results = run(parse_tool_calls(text, turn=1).calls, TOOLS)
    assert [(r.call_id, r.error) for r in results] == [
        ("call_1_0", None),
        ("call_1_1", "bad_json"),
        ("call_1_2", "unknown_tool"),
    ]


def test_tool_stats() -> None:
    stats = ToolStats()
    assert stats.metrics() == {"tools/calls": 0.0}
    stats.record_episode([ToolResult("a", "t", "1"), ToolResult("b", "t", "error", "timeout")])
    stats.record_episode([])
    stats.record_episode([ToolResult("c", "", "error", "bad_json"), ToolResult("d", "t", "error", "timeout")])
    assert stats.metrics() == {
        "tools/calls": 4.0,
        "tools/errors/bad_json": 1.0,
        "tools/errors/timeout": 2.0,
        "tools/calls_per_episode": 4 / 3,
        "tools/error_rate": 0.75,
    }
