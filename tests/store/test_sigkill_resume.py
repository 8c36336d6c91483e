"""SIGKILL a run on PostgreSQL + S3 three times (issue 16): the store stays consistent after every kill
and the resumed run ends byte-identical to an uninterrupted one. The logic is scripts/sigkill_resume.py
(its 20-kill run is the acceptance); this runs it with real trainer subprocesses, a real moto S3 server
and a real PostgreSQL schema, skipped only when PostgreSQL is unreachable."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PG_BASE_DSN = os.environ.get("ROLLOUT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sigkill_resume", ROOT / "scripts" / "sigkill_resume.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script()


@pytest.fixture
def pg_base_dsn() -> str:
    psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install 'rollout[postgres]')")
    try:
        psycopg.connect(PG_BASE_DSN, connect_timeout=3).close()
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at {PG_BASE_DSN}: {str(err).strip().splitlines()[0]}")
    return PG_BASE_DSN


@pytest.mark.slow
def test_three_sigkills_keep_the_store_consistent_and_resume_byte_identical(script, pg_base_dsn, tmp_path):
    lines: list[str] = []
    outcome = script.run_experiment(
        kills=3, seed=0, base_dsn=pg_base_dsn, steps=40, every=4, workdir=tmp_path, log=lines.append
    )
    script.report(outcome, log=lines.append)
    text = "\n".join(lines)
    assert outcome.ok, text
    assert [k.plan.kind for k in outcome.kills][-1] == "end"  # the last kill lands in the final snapshot/export
    for kill in outcome.kills:
        assert kill.problems == [], text
        assert kill.blobs == 7 * kill.rows, text  # model, optimizer, state and the 4 model-file blobs per row
        assert kill.run_status in ("-", "crashed", "succeeded"), text
    assert outcome.kills[-1].rows >= 1 and outcome.final_check.rows > outcome.kills[-1].rows
    assert set(outcome.reference) == {
        "export/model.safetensors", "train_state/model", "train_state/optimizer", "train_state/state"
    }  # fmt: skip
    assert all(len(digest) == 64 for digest in outcome.reference.values())
    assert outcome.resumed == outcome.reference
    assert outcome.problems == [] and outcome.final_check.problems == []
    assert lines[-1].startswith("PASS: 3 SIGKILLs"), text
    assert list(tmp_path.iterdir()) == []  # the workspace goes once everything held


def test_plans_are_seeded_spread_over_the_run_and_end_at_its_end(script):
    import random

    plan = script.plan_kills(random.Random(0), kills=20, steps=160)
    assert plan == script.plan_kills(random.Random(0), kills=20, steps=160)
    assert plan != script.plan_kills(random.Random(1), kills=20, steps=160)
    assert plan[-1].kind == "end" and plan[-1].target_step == 160
    targets = [k.target_step for k in plan[:-1]]
    assert all(1 <= t <= 159 for t in targets) and targets[0] <= 12 and targets[-1] >= 145
    assert {k.kind for k in plan} == {"startup", "step", "upload", "end"}


def test_an_unreachable_postgres_is_exit_2_with_one_line(script, tmp_path, capsys):
    rc = script.main(["--kills", "1", "--steps", "4", "--workdir", str(tmp_path),
                      "--postgres-dsn", "postgresql://nobody@127.0.0.1:1/none"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: PostgreSQL not reachable at postgresql://nobody@127.0.0.1:1/none: ")
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
