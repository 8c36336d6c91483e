"""`dashboard_store`: a SQLite store holding the runs of `dashboard_helpers.write_runs`."""

from __future__ import annotations

from pathlib import Path

import pytest
from dashboard_helpers import write_runs

from rollout.store import open_store


@pytest.fixture
def dashboard_store(tmp_path: Path):
    path = tmp_path / "rollout.db"
    store = open_store("embedded", path=path)
    yield write_runs(store, path)
    store.close()
