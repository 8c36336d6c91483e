"""The eval tables of SqlStore (`evals`, `eval_samples`) on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import time

import pytest
import sqlalchemy as sa
import test_sql_store

from rollout.errors import EvalNotFound, StorageError
from rollout.store import open_store
from rollout.store import sql as sql_module
from rollout.store.base import EvalSampleRecord
from rollout.store.sql import MIGRATIONS

# The SqlStore tests' fixtures: `store` is a fresh SQLite file, then a fresh PostgreSQL schema.
pg_admin, pg_dsn, store = test_sql_store.pg_admin, test_sql_store.pg_dsn, test_sql_store.store


def make_eval(store, **overrides):
    values = dict(
        model="/models/tiny", model_identity="files:abc", engine="hf", env="arithmetic",
        data_path="/data/eval.jsonl", data_digest="d" * 64, n_prompts=3, n=2, seed=7,
        success_threshold=1.0, sampling={"temperature": 1.0, "max_tokens": 8}, config_json='{"env":"arithmetic"}',
    )  # fmt: skip
    values.update(overrides)
    return store.create_eval(**values)


def make_sample(
    p: int, s: int, *, reward: float | None = 1.0, failed: bool = False, **kw
) -> EvalSampleRecord:
    values = dict(
        seed=1000 * p + s, success=reward == 1.0, answer=str(p), completion=f"answer {p}",
        messages=[{"role": "user", "content": f"q{p}"}, {"role": "assistant", "content": f"answer {p}"}],
        turns=1, tool_calls=0, finish_reason="stop", prompt_tokens=5, completion_tokens=3, truncated=False,
        error=None, created_at=1.5,
    )  # fmt: skip
    values.update(kw)
    return EvalSampleRecord(prompt_index=p, sample_index=s, reward=reward, failed=failed, **values)


def test_eval_lifecycle(store):
    record = make_eval(store, name="baseline")
    assert len(record.id) == 26 and record.status == "pending" and record.summary is None
    assert store.get_eval(record.id) == record
    assert store.get_eval(record.id[:12].lower()).id == record.id  # a unique prefix, any case

    store.set_eval_status(record.id, "running")
    running = store.get_eval(record.id)
    assert running.started_at is not None and running.heartbeat_at is not None and running.ended_at is None
    assert store.eval_heartbeat(record.id)

    summary = {"n_prompts": 3, "metrics": {"pass@1": 0.5, "avg@1": 0.25, "n_failed": 0}}  # not sorted
    store.set_eval_status(record.id, "succeeded", summary=summary, timings={"wall_s": 1.5})
    done = store.get_eval(record.id)
    assert done.status == "succeeded" and done.ended_at >= done.started_at
    assert done.summary == summary and list(done.summary["metrics"]) == ["pass@1", "avg@1", "n_failed"]
    assert done.timings == {"wall_s": 1.5} and done.sampling == {"temperature": 1.0, "max_tokens": 8}
    assert not store.eval_heartbeat(record.id)  # not running any more

    store.set_eval_status(record.id, "running")  # a resume clears the old end and error
    again = store.get_eval(record.id)
    assert again.started_at == running.started_at and again.ended_at is None and again.error is None


def test_eval_by_name_is_the_newest_with_that_name(store):
    first = make_eval(store, name="grpo")
    time.sleep(0.01)
    second = make_eval(store, name="grpo")
    other = make_eval(store, name="sft")
    assert store.get_eval("grpo").id == second.id != first.id
    assert store.get_eval("sft").id == other.id
    assert store.get_eval(first.id).id == first.id  # ids still win
    with pytest.raises(EvalNotFound, match="neither an eval id, a unique id prefix nor an eval name"):
        store.get_eval("ppo")


def test_eval_errors(store):
    with pytest.raises(EvalNotFound, match="eval not found: 01NOPE"):
        store.get_eval("01NOPE")
    with pytest.raises(EvalNotFound):
        store.set_eval_status("01NOPE0000000000000000000A", "running")
    record = make_eval(store)
    with pytest.raises(StorageError, match="invalid run status"):
        store.set_eval_status(record.id, "exploded")
    with pytest.raises(StorageError, match="constraint"):
        make_eval(store, run_id="no-such-run")  # evals during training point at a real run


def test_samples_are_stored_once_and_read_in_order(store):
    record = make_eval(store)
    other = make_eval(store)
    store.add_eval_samples(record.id, [make_sample(1, 1), make_sample(0, 1, reward=0.25)])
    # A resume re-sending a stored pair, and a pair twice in one batch: kept once, the first write wins.
    store.add_eval_samples(
        record.id, [make_sample(0, 1, reward=0.0), make_sample(0, 0), make_sample(0, 0, reward=0.0)]
    )
    store.add_eval_samples(record.id, [])
    store.add_eval_samples(
        record.id,
        [
            make_sample(
                2, 0, reward=None, failed=True, error="HTTP 500", completion=None, messages=[], turns=0
            )
        ],
    )
    store.add_eval_samples(other.id, [make_sample(0, 0)])
    samples = store.read_eval_samples(record.id)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 1), (2, 0)]
    assert [s.reward for s in samples] == [1.0, 0.25, 1.0, None]
    assert samples[0] == make_sample(0, 0) and samples[1] == make_sample(0, 1, reward=0.25)
    assert samples[3].failed and samples[3].error == "HTTP 500" and samples[3].success is False
    assert isinstance(samples[0].success, bool) and isinstance(samples[0].truncated, bool)
    assert store.count_eval_samples([record.id, other.id, "none"]) == {record.id: 4, other.id: 1}


def test_large_seeds_and_unicode_round_trip(store):
    record = make_eval(store)
    sample = make_sample(0, 0, seed=2**63 - 1, completion="ünïcode ✓", answer="ß")
    store.add_eval_samples(record.id, [sample])
    assert store.read_eval_samples(record.id) == [sample]


def test_list_evals_and_crashed_marking(store):
    first, second, third = make_eval(store, name="a"), make_eval(store, name="b"), make_eval(store, name="c")
    assert [e.name for e in store.list_evals()] == ["c", "b", "a"]
    assert [e.name for e in store.list_evals(limit=1)] == ["c"]
    for record in (first, second):
        store.set_eval_status(record.id, "running")
    assert store.mark_crashed_evals(timeout_s=60.0) == []  # fresh heartbeats
    with store._engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE evals SET heartbeat_at = :t WHERE id = :id"),
            {"t": time.time() - 120, "id": first.id},
        )
    assert store.mark_crashed_evals(timeout_s=60.0) == [first.id]
    crashed = store.get_eval(first.id)
    assert crashed.status == "crashed" and "no heartbeat" in crashed.error
    assert math.isclose(crashed.ended_at, crashed.heartbeat_at)
    assert [e.id for e in store.list_evals(status="crashed")] == [first.id]
    assert [e.id for e in store.list_evals(status="running")] == [second.id]
    assert third.status == "pending"


def test_evals_of_a_training_run(store):
    run = store.create_run(algorithm="grpo", config_digest="d", config_json="{}")
    during = make_eval(store, run_id=run.id, step=50)
    make_eval(store)
    assert [(e.id, e.step) for e in store.list_evals(run_id=run.id)] == [(during.id, 50)]


def test_a_version_2_store_gains_eval_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(sql_module, "MIGRATIONS", MIGRATIONS[:2])
    open_store("embedded", path=tmp_path / "old.db").close()
    monkeypatch.undo()
    upgraded = open_store("embedded", path=tmp_path / "old.db")
    record = make_eval(upgraded)
    upgraded.add_eval_samples(record.id, [make_sample(0, 0)])
    assert len(upgraded.read_eval_samples(record.id)) == 1
    upgraded.close()
