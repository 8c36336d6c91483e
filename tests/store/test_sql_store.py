"""SqlStore against real SQLite files and a real PostgreSQL server (skipped when unreachable)."""

from __future__ import annotations

import math
import multiprocessing
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from rollout.errors import RunNotFound, SnapshotNotFound, StorageError
from rollout.store import TERMINAL_RUN_STATUSES, EventRecord, MetricRecord, SnapshotRecord, open_store
from rollout.store import sql as sql_module
from rollout.store.sql import MIGRATIONS, apply_migrations

PG_BASE_DSN = os.environ.get("ROLLOUT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def pg_admin():
    """An autocommit psycopg connection to the test database, or a skip saying why not."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install 'rollout[postgres]')")
    try:
        conn = psycopg.connect(PG_BASE_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at {PG_BASE_DSN}: {str(err).strip().splitlines()[0]}")
    yield conn
    conn.close()


@pytest.fixture
def pg_dsn(pg_admin):
    """A DSN whose search_path is a fresh schema, dropped after the test."""
    schema = f"rollout_test_{uuid.uuid4().hex[:16]}"
    pg_admin.execute(f'CREATE SCHEMA "{schema}"')
    yield f"{PG_BASE_DSN}?options=-csearch_path%3D{schema}"
    pg_admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    if request.param == "sqlite":
        opened = open_store("embedded", path=tmp_path / "db" / "rollout.db")
    else:
        opened = open_store("postgres", dsn=request.getfixturevalue("pg_dsn"))
    yield opened
    opened.close()


def make_run(store, name: str | None = None):
    return store.create_run(algorithm="sft", config_digest="c0ffee", config_json='{"seed":0}', name=name)


def make_snapshot(
    run_id: str, snapshot_id: str, *, step: int = 0, created_at: float = 1.0, **kw
) -> SnapshotRecord:
    values = dict(kind="train_state", label=None, parent_id=None, manifest={"format": 1}, metadata={})
    values.update(kw)
    return SnapshotRecord(id=snapshot_id, run_id=run_id, step=step, created_at=created_at, **values)


# -- runs ---------------------------------------------------------------------


def test_run_lifecycle(store):
    before = time.time()
    run = store.create_run(
        algorithm="grpo", config_digest="d1", config_json="{}", name="first", resumed_from="ab" * 32
    )
    assert len(run.id) == 26 and run.status == "pending"
    assert before <= run.created_at <= time.time()
    assert store.get_run(run.id) == run

    store.set_run_status(run.id, "running")
    running = store.get_run(run.id)
    assert running.status == "running" and running.started_at is not None and running.ended_at is None
    store.set_run_status(run.id, "running")  # a second "running" keeps the first start time
    assert store.get_run(run.id).started_at == running.started_at

    store.set_run_status(run.id, "failed", error="loss became NaN at step 7")
    failed = store.get_run(run.id)
    assert failed.status == "failed" and failed.error == "loss became NaN at step 7"
    assert failed.ended_at is not None and failed.ended_at >= failed.started_at
    assert (failed.name, failed.resumed_from, failed.algorithm) == ("first", "ab" * 32, "grpo")


def test_run_errors(store):
    with pytest.raises(RunNotFound, match="run not found: nope"):
        store.get_run("nope")
    with pytest.raises(RunNotFound):
        store.set_run_status("nope", "running")
    run = make_run(store)
    with pytest.raises(StorageError, match="invalid run status"):
        store.set_run_status(run.id, "exploded")


def test_list_runs_newest_first_with_filters(store):
    runs = [make_run(store, name=f"r{i}") for i in range(4)]
    store.set_run_status(runs[1].id, "succeeded")
    store.set_run_status(runs[3].id, "succeeded")
    assert [r.name for r in store.list_runs()] == ["r3", "r2", "r1", "r0"]
    assert [r.name for r in store.list_runs(limit=2)] == ["r3", "r2"]
    assert [r.name for r in store.list_runs(status="succeeded")] == ["r3", "r1"]
    assert store.list_runs(status="cancelled") == []


def test_get_run_by_unique_prefix(store):
    insert_run_rows(store, ["01AAAAAAAA" + "B" * 16, "01AAAAAAAA" + "C" * 16, "01AAAAAAAD" + "E" * 16])
    assert store.get_run("01AAAAAAAD").id == "01AAAAAAAD" + "E" * 16  # the time part is enough when unique
    assert store.get_run("01aaaaaaaab").id == "01AAAAAAAA" + "B" * 16  # any case, like ULIDs
    with pytest.raises(RunNotFound, match="run not found: 01AAAAAAAA is an ambiguous prefix"):
        store.get_run("01AAAAAAAA")
    for missing in ("01AAAAAAA", "01AAAAAAAF", "01AAAAAAA%", "01AAAAAAAA" + "B" * 17):
        with pytest.raises(RunNotFound, match=f"run not found: {missing}$"):
            store.get_run(missing)


def insert_run_rows(store, ids: list[str]) -> None:
    """Runs with chosen ids (create_run draws them), to test prefixes deterministically."""
    with store._engine.begin() as conn:
        for run_id in ids:
            conn.execute(
                sa.text(
                    "INSERT INTO runs (id, algorithm, config_digest, config_json, status, created_at)"
                    " VALUES (:id, 'sft', 'd', '{}', 'pending', 1.0)"
                ),
                {"id": run_id},
            )


# -- liveness: heartbeats and crashed runs -------------------------------------


def age_run(store, run_id: str, seconds: float) -> None:
    """Move a run's timestamps `seconds` into the past, as if its process went quiet then."""
    with store._engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE runs SET created_at = created_at - :s, started_at = started_at - :s,"
                " heartbeat_at = heartbeat_at - :s, ended_at = ended_at - :s WHERE id = :id"
            ),
            {"s": seconds, "id": run_id},
        )


def test_heartbeat_stamps_running_runs_only(store):
    run = make_run(store)
    assert store.heartbeat(run.id) is False and store.get_run(run.id).heartbeat_at is None  # pending
    store.set_run_status(run.id, "running")
    started = store.get_run(run.id)
    assert started.heartbeat_at is not None and started.heartbeat_at >= started.started_at
    time.sleep(0.01)
    assert store.heartbeat(run.id) is True
    beat = store.get_run(run.id).heartbeat_at
    assert beat > started.heartbeat_at
    store.set_run_status(run.id, "succeeded")
    assert store.heartbeat(run.id) is False and store.get_run(run.id).heartbeat_at == beat
    assert store.heartbeat("no-such-run") is False


def test_mark_crashed_marks_only_stale_running_or_pending_runs(store):
    """A stale `pending` run is one killed between its row and its first heartbeat: crashed too."""
    assert "crashed" in TERMINAL_RUN_STATUSES
    runs = {
        name: make_run(store, name=name)
        for name in ("fresh", "stale", "legacy", "pending", "new_pending", "done", "failed")
    }
    for name in ("fresh", "stale", "legacy", "done", "failed"):
        store.set_run_status(runs[name].id, "running")
    store.set_run_status(runs["done"].id, "succeeded")
    store.set_run_status(runs["failed"].id, "failed", error="boom")
    for name in ("stale", "legacy", "pending", "done", "failed"):
        age_run(store, runs[name].id, 120.0)
    with store._engine.begin() as conn:  # a run started before heartbeats existed: only started_at
        conn.execute(sa.text("UPDATE runs SET heartbeat_at = NULL WHERE id = :id"), {"id": runs["legacy"].id})
    before = {name: store.get_run(run.id) for name, run in runs.items()}

    crashed = store.mark_crashed(timeout_s=60.0)

    assert crashed == sorted([runs["stale"].id, runs["legacy"].id, runs["pending"].id])
    for name in ("stale", "legacy", "pending"):
        after = store.get_run(runs[name].id)
        assert (after.status, after.error) == ("crashed", "no heartbeat for 60 s (process died?)")
        # ended_at is the last sign of life, so the duration is how long it really ran
        assert after.ended_at == (before[name].heartbeat_at or before[name].started_at or before[name].created_at)
    for name in ("fresh", "new_pending", "done", "failed"):
        assert store.get_run(runs[name].id) == before[name]
    assert store.mark_crashed(timeout_s=60.0) == []  # marked once
    assert store.heartbeat(runs["stale"].id) is False  # a late beat does not revive it
    assert sorted(r.name for r in store.list_runs(status="crashed")) == ["legacy", "pending", "stale"]
    assert store.mark_crashed(timeout_s=1000.0) == []


def test_concurrent_markers_mark_each_run_once(store):
    stale = [make_run(store).id for _ in range(20)]
    for run_id in stale:
        store.set_run_status(run_id, "running")
        age_run(store, run_id, 300.0)
    barrier = threading.Barrier(4)
    results: list[list[str]] = []

    def mark() -> None:
        barrier.wait()
        results.append(store.mark_crashed(timeout_s=60.0))

    threads = [threading.Thread(target=mark) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(run_id for found in results for run_id in found) == sorted(stale)


def test_summarize_runs_in_batches(store, monkeypatch):
    busy, quiet = make_run(store, "busy"), make_run(store, "quiet")
    store.append_metrics(
        [MetricRecord(busy.id, s, "train/loss", 1.0 / s) for s in (1, 2, 3)]
        + [
            MetricRecord(busy.id, 2, "rollout/reward_mean", math.nan),
            MetricRecord(busy.id, 5, "train/lr", 0.1),
        ]
    )
    for step, kind, created_at in [(1, "train_state", 1.0), (2, "train_state", 2.0), (3, "buffer", 3.0)]:
        store.add_snapshot(
            make_snapshot(busy.id, f"{step:02d}" * 32, step=step, kind=kind, created_at=created_at)
        )
    monkeypatch.setattr(sql_module, "_IN_CHUNK", 1)  # one run per chunk: chunking loses nothing

    summaries = store.summarize_runs(
        [busy.id, quiet.id, busy.id, "no-such-run"], metric_names=["rollout/reward_mean", "train/loss"]
    )

    assert set(summaries) == {busy.id, quiet.id}
    summary = summaries[busy.id]
    assert (summary.last_step, summary.last_train_state_id) == (5, "02" * 32)
    assert summary.latest["train/loss"] == pytest.approx(1 / 3) and math.isnan(
        summary.latest["rollout/reward_mean"]
    )
    assert set(summary.latest) == {"train/loss", "rollout/reward_mean"}
    assert (summaries[quiet.id].last_step, summaries[quiet.id].latest) == (None, {})
    assert summaries[quiet.id].last_train_state_id is None
    assert store.summarize_runs([busy.id], metric_names=[])[busy.id].latest == {}
    assert store.summarize_runs([], metric_names=["train/loss"]) == {}


# -- events and metrics -------------------------------------------------------


def test_events_are_read_in_seq_order(store):
    run = make_run(store)
    fields = {"loss": 0.5, "note": "résumé ✓", "nested": {"b": [1, 2], "a": None}}
    store.append_events([EventRecord(run.id, seq, 100.0 + seq, f"e{seq}", fields) for seq in (3, 0, 2, 1, 4)])
    events = store.read_events(run.id)
    assert [e.seq for e in events] == [0, 1, 2, 3, 4]
    assert events[2] == EventRecord(run.id, 2, 102.0, "e2", fields)
    assert [e.seq for e in store.read_events(run.id, after_seq=1)] == [2, 3, 4]
    assert [e.seq for e in store.read_events(run.id, after_seq=1, limit=2)] == [2, 3]
    assert store.read_events(run.id, after_seq=4) == []
    assert store.read_events("other-run") == []


def test_event_batches_are_atomic(store):
    run = make_run(store)
    store.append_events([EventRecord(run.id, 0, 1.0, "a", {})])
    with pytest.raises(StorageError, match="constraint"):
        store.append_events([EventRecord(run.id, 1, 1.0, "b", {}), EventRecord(run.id, 0, 1.0, "dup", {})])
    assert [e.name for e in store.read_events(run.id)] == ["a"]  # seq 1 rolled back with the duplicate
    with pytest.raises(StorageError):
        store.append_events([EventRecord("no-such-run", 0, 1.0, "a", {})])


def test_a_recorder_batch_of_events_and_metrics_is_one_transaction(store):
    """`append_records` (the recorder's writer, one batch per flush): both kinds land, or neither does."""
    run = make_run(store)
    store.append_records([EventRecord(run.id, 0, 1.0, "train_step", {"step": 1})],
                         [MetricRecord(run.id, 1, "train/loss", 2.0), MetricRecord(run.id, 1, "train/loss", 1.5)])
    assert [e.name for e in store.read_events(run.id)] == ["train_step"]
    assert [(m.step, m.value) for m in store.read_metrics(run.id)] == [(1, 1.5)]  # last wins within the batch
    with pytest.raises(StorageError, match=r"append 1 events and 1 metrics .*constraint"):
        store.append_records([EventRecord(run.id, 0, 2.0, "dup", {})], [MetricRecord(run.id, 2, "train/loss", 1.0)])
    with pytest.raises(StorageError, match="append 1 events and 1 metrics"):
        store.append_records([EventRecord(run.id, 1, 2.0, "train_step", {"step": 2})],
                             [MetricRecord("no-such-run", 2, "train/loss", 1.0)])
    assert [e.seq for e in store.read_events(run.id)] == [0]  # the events of both failed batches rolled back
    assert [m.step for m in store.read_metrics(run.id)] == [1]
    store.append_records([], [])  # nothing to write: no transaction, no error


def test_metrics_upsert_and_final_metrics(store):
    run = make_run(store)
    other = make_run(store)
    store.append_metrics(
        [
            MetricRecord(run.id, 1, "train/loss", 2.0),
            MetricRecord(run.id, 2, "train/loss", 1.5),
            MetricRecord(run.id, 1, "train/lr", 1e-3),
            MetricRecord(run.id, 3, "train/loss", 9.9),
            MetricRecord(run.id, 3, "train/loss", 1.25),  # same key in one batch: last wins
            MetricRecord(other.id, 7, "train/loss", 42.0),
        ]
    )
    store.append_metrics([MetricRecord(run.id, 2, "train/loss", 1.4)])  # upsert an existing row
    assert [(m.step, m.value) for m in store.read_metrics(run.id, name="train/loss")] == [
        (1, 2.0),
        (2, 1.4),
        (3, 1.25),
    ]
    assert [(m.step, m.name) for m in store.read_metrics(run.id)] == [
        (1, "train/loss"),
        (1, "train/lr"),
        (2, "train/loss"),
        (3, "train/loss"),
    ]
    assert store.final_metrics(run.id) == {"train/loss": 1.25, "train/lr": 1e-3}
    assert store.final_metrics(other.id) == {"train/loss": 42.0}
    assert store.final_metrics("nobody") == {}


def test_nan_metric_round_trips(store):
    run = make_run(store)
    store.append_metrics([MetricRecord(run.id, 0, "train/loss", math.nan)])
    assert math.isnan(store.final_metrics(run.id)["train/loss"])


# -- snapshots ----------------------------------------------------------------


def test_snapshot_round_trip_and_idempotent_add(store):
    run = make_run(store)
    record = make_snapshot(
        run.id,
        "a" * 64,
        step=5,
        label="best",
        manifest={"blobs": {"model": {"digest": "b" * 64}}},
        metadata={"eval/acc": 0.75},
    )
    store.add_snapshot(record)
    store.add_snapshot(record)
    assert store.get_snapshot("a" * 64) == record
    assert len(store.list_snapshots()) == 1
    with pytest.raises(StorageError):
        store.add_snapshot(make_snapshot("no-such-run", "c" * 64))


def test_snapshot_prefix_resolution(store):
    run = make_run(store)
    unique = "0123456789abcdef" * 4
    twin_a = "fedcba98" + "0" * 56
    twin_b = "fedcba98" + "1" * 56
    for snapshot_id in (unique, twin_a, twin_b):
        store.add_snapshot(make_snapshot(run.id, snapshot_id))
    assert store.get_snapshot(unique).id == unique
    assert store.get_snapshot(unique[:8]).id == unique
    assert store.get_snapshot(unique.upper()).id == unique
    assert store.get_snapshot(twin_a[:9]).id == twin_a
    with pytest.raises(SnapshotNotFound, match="ambiguous"):
        store.get_snapshot("fedcba98")
    for bad in (unique[:7], "deadbeefdeadbeef", "zzzzzzzz", "../../etc/passwd", "0123456%", "", unique + "0"):
        with pytest.raises(SnapshotNotFound) as caught:
            store.get_snapshot(bad)
        assert str(caught.value) == f"snapshot not found: {bad}"


def test_list_snapshots_order_filters_and_delete(store):
    run = make_run(store)
    other = make_run(store)
    rows = [
        make_snapshot(run.id, "1" * 64, step=1, created_at=10.0),
        make_snapshot(run.id, "2" * 64, step=2, created_at=20.0),
        make_snapshot(run.id, "3" * 64, step=3, created_at=20.0),  # same time: higher step first
        make_snapshot(run.id, "4" * 64, step=4, created_at=5.0, kind="buffer"),
        make_snapshot(other.id, "5" * 64, step=9, created_at=30.0),
    ]
    for row in rows:
        store.add_snapshot(row)
    assert [s.id[0] for s in store.list_snapshots()] == ["5", "3", "2", "1", "4"]
    assert [s.id[0] for s in store.list_snapshots(run_id=run.id)] == ["3", "2", "1", "4"]
    assert [s.id[0] for s in store.list_snapshots(run_id=run.id, kind="buffer")] == ["4"]
    assert [s.id[0] for s in store.list_snapshots(limit=2)] == ["5", "3"]
    assert store.delete_snapshots(["1" * 64, "3" * 64, "3" * 64, "9" * 64]) == 2
    assert [s.id[0] for s in store.list_snapshots()] == ["5", "2", "4"]
    assert store.delete_snapshots([]) == 0


# -- migrations, errors, concurrency ------------------------------------------


def assert_migrated_once(store) -> None:
    assert apply_migrations(store._engine) == []
    with store._engine.connect() as conn:
        versions = [v for (v,) in conn.exec_driver_sql("SELECT version FROM schema_migrations ORDER BY 1")]
    assert versions == list(range(1, len(MIGRATIONS) + 1))


def test_sqlite_migrations_apply_once(tmp_path):
    open_store("embedded", path=tmp_path / "m.db").close()
    store = open_store("embedded", path=tmp_path / "m.db")
    assert_migrated_once(store)
    store.close()


def test_postgres_migrations_apply_once(pg_dsn):
    open_store("postgres", dsn=pg_dsn).close()
    store = open_store("postgres", dsn=pg_dsn)
    assert_migrated_once(store)
    store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_version_1_store_gains_heartbeats(backend, tmp_path, monkeypatch, request):
    def opened():
        if backend == "sqlite":
            return open_store("embedded", path=tmp_path / "old.db")
        return open_store("postgres", dsn=request.getfixturevalue("pg_dsn"))

    monkeypatch.setattr(sql_module, "MIGRATIONS", MIGRATIONS[:1])
    old = opened()
    run_id = "01AAAAAAAA" + "V" * 16
    insert_run_rows(old, [run_id])  # what a version-1 rollout wrote: no heartbeat column
    with old._engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE runs SET status = 'running', started_at = :t WHERE id = :id"),
            {"t": time.time() - 120.0, "id": run_id},
        )
    old.close()
    monkeypatch.undo()

    store = opened()
    assert_migrated_once(store)
    migrated = store.get_run(run_id)
    assert (migrated.status, migrated.heartbeat_at) == ("running", None)
    assert store.mark_crashed(timeout_s=60.0) == [run_id]  # a v1 run that died: judged by started_at
    store.close()


def test_sqlite_pragmas(tmp_path):
    store = open_store("embedded", path=tmp_path / "p.db")
    with store._engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    store.close()


def test_locked_sqlite_database_is_a_storage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sql_module, "SQLITE_BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "locked.db"
    store = open_store("embedded", path=path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError, match="database is locked"):
            make_run(store)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    make_run(store)
    store.close()


def test_unopenable_paths_are_storage_errors(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="cannot create the directory"):
        open_store("embedded", path=blocker / "rollout.db")
    with pytest.raises(StorageError, match="unable to open database file"):
        open_store("embedded", path=tmp_path)  # a directory, not a file


def test_unreachable_postgres_is_a_storage_error():
    pytest.importorskip("psycopg")
    with pytest.raises(
        StorageError, match="PostgreSQL store postgresql\\+psycopg://u:\\*\\*\\*@127.0.0.1:1/x"
    ):
        open_store("postgres", dsn="postgresql://u:secret@127.0.0.1:1/x?connect_timeout=2")


def _write_from_process(path: str, barrier, worker: int, n_events: int) -> None:
    barrier.wait()
    store = open_store("embedded", path=Path(path))  # both race on the migrations of a fresh file
    run = store.create_run(algorithm="sft", config_digest=str(worker), config_json="{}", name=f"w{worker}")
    for start in range(0, n_events, 10):
        batch = range(start, start + 10)
        store.append_events([EventRecord(run.id, seq, time.time(), "step", {"w": worker}) for seq in batch])
        store.append_metrics([MetricRecord(run.id, seq, "train/loss", float(seq)) for seq in batch])
    store.set_run_status(run.id, "succeeded")
    store.close()


def test_two_processes_write_one_sqlite_file(tmp_path):
    path = tmp_path / "shared.db"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_write_from_process, args=(str(path), barrier, w, 200)) for w in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0]

    store = open_store("embedded", path=path)
    runs = store.list_runs()
    assert sorted(r.name for r in runs) == ["w0", "w1"]
    for run in runs:
        assert run.status == "succeeded"
        assert [e.seq for e in store.read_events(run.id)] == list(range(200))
        assert len(store.read_metrics(run.id)) == 200
        assert store.final_metrics(run.id) == {"train/loss": 199.0}
    store.close()
