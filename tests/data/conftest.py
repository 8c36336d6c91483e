"""Fixtures for the data pipeline tests: a tiny ChatML tokenizer and a JSONL writer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_chatml_tokenizer import build_chatml_tokenizer


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_chatml_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """write_jsonl(lines, name=...) -> path; dict/list lines are JSON-encoded, strings written as-is."""

    def write(lines: list[object], name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        with path.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        return path

    return write
