"""JSONL reading and per-line validation: exact located messages, skip mode, caps."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.data.jsonl import DataReport, Row, read_rows, scan_dataset
from rollout.errors import DataError

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}

NO_IMPLICIT_PROMPT = 'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'


def first_error(path: Path, kind: str) -> str:
    with pytest.raises(DataError) as info:
        read_rows(path, kind)
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "line", "problem"),
    [
        ("sft", "{not json", "invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
        ("sft", "[1, 2]", "expected a JSON object, got array"),
        ("sft", '"text"', "expected a JSON object, got string"),
        (
            "sft",
            {"foo": 1},
            'missing field "messages" (sft lines need "messages", "prompt" + "completion", or "text")',
        ),
        ("sft", {"messages": "hi"}, 'field "messages" must be a list of messages, got string'),
        ("sft", {"messages": []}, 'field "messages" must not be empty'),
        ("sft", {"messages": [USER, 3]}, "messages[1] must be an object, got number"),
        ("sft", {"messages": [{"content": "x"}]}, 'messages[0]: missing field "role"'),
        ("sft", {"messages": [{"role": "user"}]}, 'messages[0]: missing field "content"'),
        (
            "sft",
            {"messages": [{"role": "bot", "content": "x"}]},
            'messages[0]: field "role" must be one of system, user, assistant, tool, got "bot"',
        ),
        (
            "sft",
            {"messages": [{"role": ["user"], "content": "x"}]},
            'messages[0]: field "role" must be one of system, user, assistant, tool, got array',
        ),
        ("sft", {"messages": [{"role": "tool"}]}, 'messages[0]: missing field "content"'),
        ("sft", {"messages": [{"role": "bot"}]}, 'messages[0]: missing field "content"'),
        (
            "sft",
            {"messages": [{"role": 1, "content": "x"}]},
            'messages[0]: field "role" must be one of system, user, assistant, tool, got number',
        ),
        (
            "sft",
            {"messages": [USER, {"role": "assistant", "content": None}]},
            'messages[1]: field "content" must be a string, got null',
        ),
        ("sft", {"messages": [USER]}, 'field "messages" has no assistant message'),
        ("sft", {"prompt": "a"}, 'missing field "completion"'),
        ("sft", {"completion": "a"}, 'missing field "prompt"'),
        ("sft", {"prompt": "", "completion": "a"}, 'field "prompt" must not be empty'),
        (
            "sft",
            {"prompt": 1, "completion": "a"},
            'field "prompt" must be a string or a list of messages, got number',
        ),
        (
            "sft",
            {"prompt": "a", "completion": [ASSISTANT]},
            'fields "prompt" and "completion" must all be strings or all be lists of messages',
        ),
        ("sft", {"prompt": [USER], "completion": [USER]}, 'field "completion" has no assistant message'),
        ("sft", {"text": 5}, 'field "text" must be a string, got number'),
        ("sft", {"text": ""}, 'field "text" must not be empty'),
        ("preference", {"prompt": "p", "rejected": "r"}, 'missing field "chosen"'),
        ("preference", {"chosen": "c", "rejected": "r"}, NO_IMPLICIT_PROMPT),
        ("preference", {"prompt": "p", "chosen": "c"}, 'missing field "rejected"'),
        (
            "preference",
            {"prompt": "p", "chosen": 1.5, "rejected": "r"},
            'field "chosen" must be a string or a list of messages, got number',
        ),
        (
            "preference",
            {"prompt": "p", "chosen": "c", "rejected": True},
            'field "rejected" must be a string or a list of messages, got boolean',
        ),
        ("preference", {"prompt": "p", "chosen": "", "rejected": "r"}, 'field "chosen" must not be empty'),
        ("preference", {"prompt": "p", "chosen": [], "rejected": "r"}, 'field "chosen" must not be empty'),
        (
            "preference",
            {"prompt": "p", "chosen": "same", "rejected": "same"},
            "chosen and rejected are identical",
        ),
        (
            "preference",
            {"prompt": [USER], "chosen": [ASSISTANT], "rejected": [ASSISTANT]},
            "chosen and rejected are identical",
        ),
        (
            "preference",
            {"prompt": [USER], "chosen": "c", "rejected": "r"},
            'fields "prompt", "chosen" and "rejected" must all be strings or all be lists of messages',
        ),
        (
            "preference",
            {"prompt": "p", "chosen": [USER], "rejected": "r"},
            'field "chosen" has no assistant message',
        ),
        ("kto", {"prompt": "p", "completion": "c"}, 'missing field "label"'),
        (
            "kto",
            {"prompt": "p", "completion": "c", "label": 1},
            'field "label" must be a boolean, got number',
        ),
        (
            "kto",
            {"prompt": "p", "completion": "c", "label": "true"},
            'field "label" must be a boolean, got string',
        ),
        ("kto", {"completion": "c", "label": True}, 'missing field "prompt"'),
        ("prompt", {"answer": 3}, 'missing field "prompt"'),
        ("prompt", {"prompt": None}, 'field "prompt" must be a string or a list of messages, got null'),
        (
            "prompt",
            {"prompt": {"role": "user"}},
            'field "prompt" must be a string or a list of messages, got object',
        ),
        (
            "prompt",
            {"prompt": [{"role": "user", "content": []}]},
            'prompt[0]: field "content" must be a string, got array',
        ),
    ],
)
def test_bad_line_is_located(write_jsonl, kind, line, problem):
    good = {
        "sft": {"text": "ok"},
        "preference": {"prompt": "p", "chosen": "c", "rejected": "r"},
        "kto": {"prompt": "p", "completion": "c", "label": False},
        "prompt": {"prompt": "p"},
    }[kind]
    path = write_jsonl([good, good, line, good])
    assert first_error(path, kind) == f"{path}:3: {problem}"


@pytest.mark.parametrize(
    ("kind", "line"),
    [
        (
            "sft",
            {
                "messages": [
                    {"role": "system", "content": ""},
                    USER,
                    ASSISTANT,
                    {"role": "tool", "content": "x"},
                ]
            },
        ),
        ("sft", {"prompt": "2+2=", "completion": "4"}),
        ("sft", {"prompt": [USER], "completion": [ASSISTANT], "extra": 1}),
        ("sft", {"text": "plain"}),
        ("preference", {"prompt": "p", "chosen": "c", "rejected": "r"}),
        (
            "preference",
            {"prompt": [USER], "chosen": [ASSISTANT], "rejected": [{"role": "assistant", "content": "no"}]},
        ),
        ("kto", {"prompt": "p", "completion": "c", "label": True}),
        ("kto", {"prompt": [USER], "completion": [ASSISTANT], "label": False}),
        ("prompt", {"prompt": "What is 2+2?", "answer": "4", "meta": {"x": [1]}}),
        ("prompt", {"prompt": [USER]}),
    ],
)
def test_valid_lines_pass_through(write_jsonl, kind, line):
    path = write_jsonl([line])
    rows, report = read_rows(path, kind)
    assert rows == [Row(line=1, data=line)]
    assert report == DataReport(path=path, num_lines=1, num_valid=1, num_skipped=0, errors=())


def test_blank_lines_are_ignored_but_keep_line_numbers(write_jsonl):
    path = write_jsonl(["", {"text": "a"}, "   ", "\t", {"text": "b"}, "", "{bad"])
    rows, report = read_rows(path, "sft", on_bad_line="skip")
    assert [r.line for r in rows] == [2, 5]
    assert (report.num_lines, report.num_valid, report.num_skipped) == (3, 2, 1)
    assert report.errors[0].startswith(f"{path}:7: invalid JSON: ")


@pytest.mark.parametrize("level", ["info", "warning"])
def test_scanning_a_large_file_reports_its_progress(level, tmp_path, monkeypatch, capsys):
    """A file of `ByteProgress.MIN_BYTES` or more (here lowered to 1 MiB) shows how far a scan has
    got, every ~5% of its bytes, as plain lines off a TTY; above log level info, nothing."""
    from rollout.progress import ByteProgress

    monkeypatch.setattr(ByteProgress, "MIN_BYTES", 1 << 20)
    monkeypatch.setenv("ROLLOUT_LOG", level)
    line = json.dumps({"text": "x" * 1000}) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(line * 4200)  # ~4 MiB
    report = scan_dataset(path, "sft")
    assert report.num_valid == 4200
    shown = capsys.readouterr().err.splitlines()
    if level == "warning":
        assert shown == []
        return
    assert 18 <= len(shown) <= 21, shown
    assert all(s.startswith(f"read={path} mb=") and s.endswith("/4") for s in shown), shown
    assert shown[-1] == f"read={path} mb=4/4"
    small = tmp_path / "small.jsonl"
    small.write_text(line)
    read_rows(small, "sft")
    assert capsys.readouterr().err == ""  # a small file: no progress


def test_skip_mode_counts_and_keeps_valid_rows(write_jsonl):
    lines = [{"text": "a"}, {"text": 1}, "nope", {"text": "b"}, {"messages": []}, {"text": "c"}]
    path = write_jsonl(lines)
    rows, report = read_rows(path, "sft", on_bad_line="skip")
    assert [r.data["text"] for r in rows] == ["a", "b", "c"]
    assert [r.line for r in rows] == [1, 4, 6]
    assert report.num_lines == 6 and report.num_valid == 3 and report.num_skipped == 3
    assert report.errors == (
        f'{path}:2: field "text" must be a string, got number',
        f"{path}:3: invalid JSON: Expecting value (column 1)",
        f'{path}:5: field "messages" must not be empty',
    )
    assert scan_dataset(path, "sft", on_bad_line="skip") == report


def test_error_details_are_capped_at_20_with_a_count(write_jsonl):
    lines = [{"text": "ok"}] + [{"text": i} for i in range(30)]
    path = write_jsonl(lines)
    with pytest.raises(DataError) as info:
        scan_dataset(path, "sft")
    err = info.value
    assert str(err) == f'{path}:2: field "text" must be a string, got number'
    assert len(err.details) == 21
    assert err.details[0] == f'{path}:3: field "text" must be a string, got number'
    assert err.details[19] == f'{path}:22: field "text" must be a string, got number'
    assert err.details[20] == "... and 9 more bad lines"
    _, report = read_rows(path, "sft", on_bad_line="skip")
    assert report.num_skipped == 30 and len(report.errors) == 20


def test_few_errors_have_no_more_line(write_jsonl):
    path = write_jsonl([{"text": 1}, {"text": 2}, {"text": "ok"}])
    with pytest.raises(DataError) as info:
        read_rows(path, "sft")
    assert info.value.details == [f'{path}:2: field "text" must be a string, got number']


def test_missing_file_and_empty_file(tmp_path, write_jsonl):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"^dataset not found: .*nope\.jsonl$"):
        read_rows(missing, "sft")
    with pytest.raises(DataError, match="dataset not found"):
        scan_dataset(tmp_path, "sft")  # a directory is not a dataset
    empty = write_jsonl(["", "  "], name="empty.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl: no data lines"):
        read_rows(empty, "sft")
    all_bad = write_jsonl([{"text": 1}], name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl: no valid lines \(1 bad lines skipped\)"):
        read_rows(all_bad, "sft", on_bad_line="skip")


def test_invalid_utf8_is_a_located_error(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    assert first_error(path, "sft") == f"{path}:2: invalid UTF-8 at byte 10"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": "a"}', b'{"text": "a"}\n', b'{"text": "a"}\r\n', b'{"text": "a"}  \t \n',
        b'  {"text": "a"}\n', b'\t[1, 2]\n', b'"s"', b"3", b"null\n", b"NaN\n", b"-Infinity",
        b'{"a": 1}{"b": 2}', b'{"a": 1} x', b'{"a": 1}\x0c\n', b'{"a": 1}\xc2\xa0', b"{bad",
        b"\xef\xbb\xbf{}", b'{"a": "\\ud800"}', b"[" * 100_000 + b"]" * 100_000, b"[" * 100_000,
    ],
)
def test_a_line_parses_exactly_as_json_loads_says(raw):
    """`_parse_line`'s fast path (raw_decode) takes only what `json.loads` takes, gives its value,
    and leaves every other line, its message included, to `json.loads` (`\\x0c` and a no-break
    space after the value are not JSON whitespace: extra data)."""
    from rollout.data.jsonl import _parse_line

    text = raw.decode("utf-8")
    try:
        expected: tuple[object, str | None] = (json.loads(text), None)
    except json.JSONDecodeError as exc:
        expected = (None, f"invalid JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        expected = (None, "invalid JSON: nested too deeply")
    got = _parse_line(raw)
    if expected[0] != expected[0]:  # NaN
        assert got[0] != got[0] and got[1] is None
    else:
        assert got == expected


def test_jsonl_does_not_import_heavy_modules():
    code = (
        "import sys, rollout.data.jsonl; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_100k_lines_scan_quickly(write_jsonl, tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"messages": [USER, ASSISTANT]})
    path.write_text((line + "\n") * 100_000)
    start = time.perf_counter()
    report = scan_dataset(path, "sft")
    rows, _ = read_rows(path, "sft")
    elapsed = time.perf_counter() - start
    assert report.num_valid == 100_000 and len(rows) == 100_000
    print(f"scan + read of 100k lines: {elapsed:.2f}s")
