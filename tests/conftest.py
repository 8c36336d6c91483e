"""Suite-wide ordering: the two longest test files (a whole learning chain each, ~4-6 min on one
core) are collected first, so that `make test` (pytest-xdist `--dist loadfile
--no-loadscope-reorder`) hands one to each worker at the start instead of queueing both last on
the same worker (xdist's default reorder puts files with the fewest tests at the end)."""

from __future__ import annotations

import pytest

FIRST = (
    "tests/integration/test_calculator_learning.py",
    "tests/integration/test_guess_learning.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))  # stable: the rest keep their order
