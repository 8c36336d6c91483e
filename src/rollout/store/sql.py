"""`SqlStore`: the metadata store over SQLAlchemy Core, for SQLite and PostgreSQL.

SQLite (the embedded backend) runs in WAL mode with `synchronous=FULL` and a
busy timeout so several processes can share one file; every write transaction
starts with `BEGIN IMMEDIATE`, which takes the write lock up front instead of
failing on a read-to-write lock upgrade. PostgreSQL goes through psycopg 3.

The schema is versioned: `MIGRATIONS` is an ordered list applied on open, each
step once, inside a transaction that holds a lock (SQLite's write lock, or a
PostgreSQL advisory lock) so two processes opening the same store is safe.

Float metric values: SQLite stores NaN as NULL, so a NULL value reads back as NaN.

About 670 lines on purpose: one implementation of the `Store` protocol for both
databases (runs, events, metrics, snapshots, heartbeats), whose queries share the
connection, retry and migration rules; the eval tables live in `sql_evals.py`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from ulid import ULID

from rollout.errors import EvalNotFound, RunNotFound, SnapshotNotFound, StorageError
from rollout.store import sql_evals
from rollout.store.base import (
    RUN_STATUSES,
    TERMINAL_RUN_STATUSES,
    EvalRecord,
    EvalSampleRecord,
    EvalStatus,
    EventRecord,
    MetricRecord,
    RunRecord,
    RunStatus,
    RunSummary,
    SnapshotRecord,
)

SQLITE_BUSY_TIMEOUT_S = 30.0
PG_CONNECT_TIMEOUT_S = 5
PG_MIGRATION_LOCK_KEY = 0x726F6C6C  # "roll": an arbitrary, fixed advisory-lock key
_HEX_PREFIX = re.compile(r"[0-9a-f]{8,64}")
_ULID_PREFIX = re.compile(r"[0-9A-HJKMNP-TV-Z]{10,25}")  # Crockford base32; 10 chars = the time part
_IN_CHUNK = 500
_DELETE_CHUNK = 500

_CREATE_MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_migrations"
    " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
)

# Ordered schema steps; append, never edit. DDL valid on both SQLite and PostgreSQL.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            algorithm TEXT NOT NULL,
            config_digest TEXT NOT NULL,
            config_json TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            ended_at DOUBLE PRECISION,
            error TEXT,
            resumed_from TEXT,
            name TEXT)""",
        "CREATE INDEX ix_runs_created_at ON runs (created_at)",
        """CREATE TABLE events (
            run_id TEXT NOT NULL REFERENCES runs (id),
            seq BIGINT NOT NULL,
            time DOUBLE PRECISION NOT NULL,
            name TEXT NOT NULL,
            fields TEXT NOT NULL,
            PRIMARY KEY (run_id, seq))""",
        """CREATE TABLE metrics (
            run_id TEXT NOT NULL REFERENCES runs (id),
            step BIGINT NOT NULL,
            name TEXT NOT NULL,
            value DOUBLE PRECISION,
            PRIMARY KEY (run_id, step, name))""",
        """CREATE TABLE snapshots (
            id TEXT PRIMARY KEY,
            run_id TEXT NOT NULL REFERENCES runs (id),
            kind TEXT NOT NULL,
            step BIGINT NOT NULL,
            label TEXT,
            parent_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            manifest TEXT NOT NULL,
            metadata TEXT NOT NULL)""",
        "CREATE INDEX ix_snapshots_run_kind_step ON snapshots (run_id, kind, step)",
        "CREATE INDEX ix_snapshots_created_at ON snapshots (created_at)",
    ),
    (
        # Liveness of running runs (see `SqlStore.mark_crashed`).
        "ALTER TABLE runs ADD COLUMN heartbeat_at DOUBLE PRECISION",
        # A metric's last step per run without scanning the run's other metrics (listings).
        "CREATE INDEX ix_metrics_run_name_step ON metrics (run_id, name, step)",
    ),
    # `rollout eval`: evals and one row per scored sample (see `sql_evals.py`).
    sql_evals.EVAL_TABLES_MIGRATION,
]


def _table(name: str, columns: str) -> sa.TableClause:
    """A lightweight table handle for queries (the DDL lives in MIGRATIONS)."""
    return sa.table(name, *(sa.column(column) for column in columns.split()))


_migrations = _table("schema_migrations", "version applied_at")
_runs = _table(
    "runs",
    "id algorithm config_digest config_json status created_at started_at ended_at error resumed_from name"
    " heartbeat_at",
)
_events = _table("events", "run_id seq time name fields")
_metrics = _table("metrics", "run_id step name value")
_snapshots = _table("snapshots", "id run_id kind step label parent_id created_at manifest metadata")


def dump_json_text(obj: object, *, allow_nan: bool) -> str:
    """Canonical JSON text for a JSON column (sorted keys, compact, UTF-8)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


class SqlStore:
    """The `Store` over one SQLAlchemy engine. Build it with `open_sqlite` / `open_postgres`."""

    def __init__(self, engine: sa.Engine, *, location: str) -> None:
        self._engine = engine
        self._location = location  # for error messages; never holds a password
        self._dialect = engine.dialect.name
        try:
            with self._errors("apply schema migrations"):
                apply_migrations(engine)
        except StorageError:
            engine.dispose()
            raise

    # -- runs ---------------------------------------------------------------

    def create_run(
        self,
        *,
        algorithm: str,
        config_digest: str,
        config_json: str,
        name: str | None = None,
        resumed_from: str | None = None,
    ) -> RunRecord:
        record = RunRecord(
            id=str(ULID()),
            algorithm=algorithm,
            config_digest=config_digest,
            config_json=config_json,
            status="pending",
            created_at=time.time(),
            started_at=None,
            ended_at=None,
            error=None,
            resumed_from=resumed_from,
            name=name,
        )
        with self._write("create a run") as conn:
            conn.execute(_runs.insert().values(**record.__dict__))
        return record

    def set_run_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None:
        _check_status(status)
        now = time.time()
        values: dict[str, Any] = {"status": status}
        if status == "running":
            values["started_at"] = sa.func.coalesce(_runs.c.started_at, now)
            values["heartbeat_at"] = now
        if status in TERMINAL_RUN_STATUSES:
            values["ended_at"] = now
        if error is not None:
            values["error"] = error
        with self._write("update a run's status") as conn:
            updated = conn.execute(_runs.update().where(_runs.c.id == run_id).values(**values)).rowcount
        if updated == 0:
            raise RunNotFound(f"run not found: {run_id}")

    def heartbeat(self, run_id: str) -> bool:
        statement = (
            _runs.update()
            .where(_runs.c.id == run_id, _runs.c.status == "running")
            .values(heartbeat_at=time.time())
        )
        with self._write("record a heartbeat") as conn:
            return conn.execute(statement).rowcount > 0

    def mark_crashed(self, *, timeout_s: float) -> list[str]:
        now = time.time()
        last_alive = sa.func.coalesce(_runs.c.heartbeat_at, _runs.c.started_at, _runs.c.created_at)
        # `pending`: killed between its row and its first beat (it has no heartbeat: created_at counts)
        stale = sa.and_(_runs.c.status.in_(("pending", "running")), last_alive < now - timeout_s)
        # A read first: the common case (nothing stale) takes no write lock, and works on a read-only store.
        with self._read("look for crashed runs") as conn:
            if conn.execute(sa.select(_runs.c.id).where(stale).limit(1)).first() is None:
                return []
        # The UPDATE re-checks `stale` row by row under the write lock, so a heartbeat or a final
        # status that landed since the read wins, and concurrent markers mark each run once.
        statement = (
            _runs.update()
            .where(stale)
            .values(
                status="crashed",
                ended_at=last_alive,  # the last sign of life, so durations show how long it really ran
                error=f"no heartbeat for {timeout_s:g} s (process died?)",
            )
            .returning(_runs.c.id)
        )
        with self._write("mark crashed runs") as conn:
            return sorted(run_id for (run_id,) in conn.execute(statement))

    def get_run(self, run_id: str) -> RunRecord:
        with self._read("read a run") as conn:
            row = conn.execute(sa.select(_runs).where(_runs.c.id == run_id)).mappings().first()
            prefix = run_id.strip().upper()
            if row is None and _ULID_PREFIX.fullmatch(prefix):
                # A prefix is the id range [prefix, prefix + "ZZZ…"], like snapshot prefixes.
                query = (
                    sa.select(_runs)
                    .where(_runs.c.id >= prefix, _runs.c.id <= prefix + "Z" * (26 - len(prefix)))
                    .limit(2)
                )
                rows = conn.execute(query).mappings().all()
                if len(rows) > 1:
                    raise RunNotFound(
                        f"run not found: {run_id} is an ambiguous prefix (matches several runs)",
                        details=["give more characters of the id"],
                    )
                row = rows[0] if rows else None
        if row is None:
            raise RunNotFound(f"run not found: {run_id}")
        return RunRecord(**row)

    def list_runs(self, *, limit: int | None = None, status: str | None = None) -> list[RunRecord]:
        query = sa.select(_runs).order_by(_runs.c.created_at.desc(), _runs.c.id.desc()).limit(limit)
        if status is not None:
            _check_status(status)
            query = query.where(_runs.c.status == status)
        with self._read("list runs") as conn:
            return [RunRecord(**row) for row in conn.execute(query).mappings()]

    # -- events and metrics -------------------------------------------------

    def append_events(self, events: Sequence[EventRecord]) -> None:
        self.append_records(events, ())

    def read_events(self, run_id: str, *, after_seq: int = -1, limit: int | None = None) -> list[EventRecord]:
        query = (
            sa.select(_events)
            .where(_events.c.run_id == run_id, _events.c.seq > after_seq)
            .order_by(_events.c.seq)
            .limit(limit)
        )
        with self._read("read events") as conn:
            rows = conn.execute(query).mappings().all()
        return [
            EventRecord(
                run_id=r["run_id"],
                seq=r["seq"],
                time=r["time"],
                name=r["name"],
                fields=json.loads(r["fields"]),
            )
            for r in rows
        ]

    def append_metrics(self, metrics: Sequence[MetricRecord]) -> None:
        self.append_records((), metrics)

    def append_records(self, events: Sequence[EventRecord], metrics: Sequence[MetricRecord]) -> None:
        if not events and not metrics:
            return
        what = " and ".join(f"{len(xs)} {kind}" for kind, xs in (("events", events), ("metrics", metrics)) if xs)
        with self._write(f"append {what}") as conn:
            if events:
                conn.execute(_events.insert(), _event_rows(events))
            if metrics:
                insert = self._insert(_metrics)
                upsert = insert.on_conflict_do_update(
                    index_elements=["run_id", "step", "name"], set_={"value": insert.excluded.value}
                )
                conn.execute(upsert, _metric_rows(metrics))

    def read_metrics(self, run_id: str, *, name: str | None = None) -> list[MetricRecord]:
        query = (
            sa.select(_metrics).where(_metrics.c.run_id == run_id).order_by(_metrics.c.step, _metrics.c.name)
        )
        if name is not None:
            query = query.where(_metrics.c.name == name)
        with self._read("read metrics") as conn:
            rows = conn.execute(query).mappings().all()
        return [MetricRecord(r["run_id"], r["step"], r["name"], _read_float(r["value"])) for r in rows]

    def final_metrics(self, run_id: str) -> dict[str, float]:
        last = (
            sa.select(_metrics.c.name, sa.func.max(_metrics.c.step).label("step"))
            .where(_metrics.c.run_id == run_id)
            .group_by(_metrics.c.name)
            .subquery()
        )
        query = (
            sa.select(_metrics.c.name, _metrics.c.value)
            .join(last, sa.and_(_metrics.c.name == last.c.name, _metrics.c.step == last.c.step))
            .where(_metrics.c.run_id == run_id)
            .order_by(_metrics.c.name)
        )
        with self._read("read final metrics") as conn:
            return {name: _read_float(value) for name, value in conn.execute(query)}

    def summarize_runs(self, run_ids: Sequence[str], *, metric_names: Sequence[str]) -> dict[str, RunSummary]:
        # Per chunk of runs, two statements: one row per run (correlated subqueries, each an index
        # seek), and each named metric's last value (a join on max(step), ix_metrics_run_name_step).
        last_step = (  # ORDER BY ... LIMIT 1 rather than max(): one backward step on the primary key
            sa.select(_metrics.c.step)
            .where(_metrics.c.run_id == _runs.c.id)
            .order_by(_metrics.c.step.desc())
            .limit(1)
            .scalar_subquery()
        )
        last_train_state = (
            sa.select(_snapshots.c.id)
            .where(_snapshots.c.run_id == _runs.c.id, _snapshots.c.kind == "train_state")
            .order_by(_snapshots.c.created_at.desc(), _snapshots.c.step.desc(), _snapshots.c.id)
            .limit(1)
            .scalar_subquery()
        )
        unique = sorted(set(run_ids))
        summaries: dict[str, RunSummary] = {}
        with self._read(f"summarize {len(unique)} runs") as conn:
            for start in range(0, len(unique), _IN_CHUNK):
                chunk = unique[start : start + _IN_CHUNK]
                latest: dict[str, dict[str, float]] = {run_id: {} for run_id in chunk}
                if metric_names:
                    last = (
                        sa.select(
                            _metrics.c.run_id, _metrics.c.name, sa.func.max(_metrics.c.step).label("step")
                        )
                        .where(_metrics.c.run_id.in_(chunk), _metrics.c.name.in_(list(metric_names)))
                        .group_by(_metrics.c.run_id, _metrics.c.name)
                        .subquery()
                    )
                    values = sa.select(_metrics.c.run_id, _metrics.c.name, _metrics.c.value).join(
                        last,
                        sa.and_(
                            _metrics.c.run_id == last.c.run_id,
                            _metrics.c.name == last.c.name,
                            _metrics.c.step == last.c.step,
                        ),
                    )
                    for run_id, name, value in conn.execute(values):
                        latest[run_id][name] = _read_float(value)
                rows = conn.execute(
                    sa.select(
                        _runs.c.id, last_step.label("last_step"), last_train_state.label("snapshot_id")
                    ).where(_runs.c.id.in_(chunk))
                )
                for run_id, step, snapshot_id in rows:
                    summaries[run_id] = RunSummary(
                        run_id=run_id,
                        last_step=None if step is None else int(step),
                        latest=latest[run_id],
                        last_train_state_id=snapshot_id,
                    )
        return summaries

    # -- snapshots ----------------------------------------------------------

    def add_snapshot(self, record: SnapshotRecord) -> None:
        row = {
            **record.__dict__,
            "manifest": dump_json_text(record.manifest, allow_nan=False),
            "metadata": dump_json_text(record.metadata, allow_nan=True),
        }
        statement = self._insert(_snapshots).values(**row).on_conflict_do_nothing(index_elements=["id"])
        with self._write(f"add snapshot {record.id}") as conn:
            conn.execute(statement)

    def get_snapshot(self, id_or_prefix: str) -> SnapshotRecord:
        prefix = id_or_prefix.strip().lower()
        if not _HEX_PREFIX.fullmatch(prefix):
            raise SnapshotNotFound(f"snapshot not found: {id_or_prefix}")
        # A hex prefix is the id range [prefix, prefix + "fff…"]: index-friendly and no LIKE wildcards.
        query = (
            sa.select(_snapshots)
            .where(_snapshots.c.id >= prefix, _snapshots.c.id <= prefix + "f" * (64 - len(prefix)))
            .limit(2)
        )
        with self._read("read a snapshot") as conn:
            rows = conn.execute(query).mappings().all()
        if not rows:
            raise SnapshotNotFound(f"snapshot not found: {id_or_prefix}")
        if len(rows) > 1:
            raise SnapshotNotFound(
                f"snapshot not found: {id_or_prefix} is an ambiguous prefix (matches several snapshots)",
                details=["give more characters of the id"],
            )
        return _snapshot_from_row(rows[0])

    def list_snapshots(
        self, *, run_id: str | None = None, kind: str | None = None, limit: int | None = None
    ) -> list[SnapshotRecord]:
        query = (
            sa.select(_snapshots)
            .order_by(_snapshots.c.created_at.desc(), _snapshots.c.step.desc(), _snapshots.c.id)
            .limit(limit)
        )
        if run_id is not None:
            query = query.where(_snapshots.c.run_id == run_id)
        if kind is not None:
            query = query.where(_snapshots.c.kind == kind)
        with self._read("list snapshots") as conn:
            return [_snapshot_from_row(row) for row in conn.execute(query).mappings()]

    def delete_snapshots(self, ids: Sequence[str]) -> int:
        unique = sorted(set(ids))
        deleted = 0
        with self._write(f"delete {len(unique)} snapshots") as conn:
            for start in range(0, len(unique), _DELETE_CHUNK):
                chunk = unique[start : start + _DELETE_CHUNK]
                deleted += conn.execute(_snapshots.delete().where(_snapshots.c.id.in_(chunk))).rowcount
        return deleted

    # -- evals (statements in sql_evals.py) ---------------------------------

    def create_eval(
        self,
        *,
        model: str,
        model_identity: str | None,
        engine: str,
        env: str,
        data_path: str | None,
        data_digest: str | None,
        n_prompts: int,
        n: int,
        seed: int,
        success_threshold: float,
        sampling: dict,
        config_json: str,
        name: str | None = None,
        run_id: str | None = None,
        step: int | None = None,
    ) -> EvalRecord:
        record = sql_evals.new_eval_record(
            model=model, model_identity=model_identity, engine=engine, env=env, data_path=data_path,
            data_digest=data_digest, n_prompts=n_prompts, n=n, seed=seed,
            success_threshold=success_threshold, sampling=sampling, config_json=config_json, name=name,
            run_id=run_id, step=step,
        )  # fmt: skip
        with self._write("create an eval") as conn:
            sql_evals.insert_eval(conn, record)
        return record

    def set_eval_status(
        self,
        eval_id: str,
        status: EvalStatus,
        *,
        error: str | None = None,
        summary: dict | None = None,
        timings: dict | None = None,
    ) -> None:
        _check_status(status)
        with self._write("update an eval's status") as conn:
            updated = sql_evals.update_eval_status(
                conn, eval_id, status, error=error, summary=summary, timings=timings
            )
        if updated == 0:
            raise EvalNotFound(f"eval not found: {eval_id}")

    def eval_heartbeat(self, eval_id: str) -> bool:
        with self._write("record an eval heartbeat") as conn:
            return sql_evals.stamp_eval_heartbeat(conn, eval_id)

    def mark_crashed_evals(self, *, timeout_s: float) -> list[str]:
        with self._read("look for crashed evals") as conn:  # no write lock in the common case
            if not sql_evals.any_stale_eval(conn, timeout_s):
                return []
        with self._write("mark crashed evals") as conn:
            return sql_evals.crash_stale_evals(conn, timeout_s)

    def get_eval(self, eval_id: str) -> EvalRecord:
        with self._read("read an eval") as conn:
            return sql_evals.select_eval(conn, eval_id)

    def list_evals(
        self, *, limit: int | None = None, status: str | None = None, run_id: str | None = None
    ) -> list[EvalRecord]:
        if status is not None:
            _check_status(status)
        with self._read("list evals") as conn:
            return sql_evals.select_evals(conn, limit=limit, status=status, run_id=run_id)

    def add_eval_samples(self, eval_id: str, samples: Sequence[EvalSampleRecord]) -> None:
        if not samples:
            return
        with self._write(f"add {len(samples)} eval samples") as conn:
            sql_evals.insert_eval_samples(conn, self._insert, eval_id, samples)

    def read_eval_samples(self, eval_id: str) -> list[EvalSampleRecord]:
        with self._read("read eval samples") as conn:
            return sql_evals.select_eval_samples(conn, eval_id)

    def count_eval_samples(self, eval_ids: Sequence[str]) -> dict[str, int]:
        with self._read("count eval samples") as conn:
            return sql_evals.count_samples(conn, eval_ids)

    def close(self) -> None:
        self._engine.dispose()

    # -- plumbing -----------------------------------------------------------

    def _insert(self, table: sa.TableClause) -> Any:
        return (pg_dialect if self._dialect == "postgresql" else sqlite_dialect).insert(table)

    @contextmanager
    def _write(self, action: str) -> Iterator[sa.Connection]:
        with self._errors(action), self._engine.connect() as conn:
            conn = conn.execution_options(rollout_write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self, action: str) -> Iterator[sa.Connection]:
        with self._errors(action), self._engine.connect() as conn:
            yield conn

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except sa.exc.IntegrityError as err:
            raise StorageError(
                f"cannot {action} in {self._location}: constraint violated ({_first_line(err)})",
                details=[
                    "events need a unique (run_id, seq); events, metrics and snapshots need an existing run"
                ],
            ) from err
        except sa.exc.SQLAlchemyError as err:
            raise StorageError(f"cannot {action} in {self._location}: {_first_line(err)}") from err


def _event_rows(events: Sequence[EventRecord]) -> list[dict[str, Any]]:
    return [
        {"run_id": e.run_id, "seq": e.seq, "time": e.time, "name": e.name,
         "fields": dump_json_text(e.fields, allow_nan=True)}
        for e in events
    ]


def _metric_rows(metrics: Sequence[MetricRecord]) -> list[dict[str, Any]]:
    """One row per (run_id, step, name), the last value winning: also inside one batch (PostgreSQL
    refuses to upsert a row twice in one statement)."""
    latest = {(m.run_id, m.step, m.name): m.value for m in metrics}
    return [{"run_id": r, "step": s, "name": n, "value": v} for (r, s, n), v in latest.items()]


def apply_migrations(engine: sa.Engine) -> list[int]:
    """Apply every pending step of `MIGRATIONS` (each in its own locked transaction); returns those applied."""
    applied: list[int] = []
    for version, statements in enumerate(MIGRATIONS, start=1):
        with engine.connect() as conn:
            conn = conn.execution_options(rollout_write=True)
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    # Serialises concurrent migrators; released at commit.
                    conn.execute(
                        sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY}
                    )
                conn.exec_driver_sql(_CREATE_MIGRATIONS_TABLE)
                done = conn.execute(sa.select(_migrations.c.version).where(_migrations.c.version == version))
                if done.first() is not None:
                    continue
                for statement in statements:
                    conn.exec_driver_sql(statement)
                conn.execute(_migrations.insert().values(version=version, applied_at=time.time()))
                applied.append(version)
    return applied


def open_sqlite(path: Path) -> SqlStore:
    """A `SqlStore` on the SQLite file at `path` (created if missing; its directory must exist)."""
    engine = sa.create_engine(
        sa.engine.URL.create("sqlite+pysqlite", database=str(path)),
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
    )
    sa.event.listen(engine, "connect", _configure_sqlite_connection)
    sa.event.listen(engine, "begin", _begin_sqlite_transaction)
    return SqlStore(engine, location=f"SQLite store {path}")


def open_postgres(dsn: str) -> SqlStore:
    """A `SqlStore` on PostgreSQL; `postgresql://` / `postgres://` DSNs are routed to psycopg 3."""
    try:
        import psycopg  # noqa: F401
    except ImportError as err:
        raise StorageError("the postgres store needs psycopg: pip install 'rollout[postgres]'") from err
    url = re.sub(r"^(postgresql|postgres)(\+\w+)?://", "postgresql+psycopg://", dsn.strip())
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as err:
        raise StorageError(f"invalid PostgreSQL DSN: {err}") from err
    connect_args = {} if "connect_timeout" in parsed.query else {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    engine = sa.create_engine(parsed, connect_args=connect_args, pool_pre_ping=True)
    return SqlStore(engine, location=f"PostgreSQL store {parsed.render_as_string(hide_password=True)}")


def _configure_sqlite_connection(dbapi_connection: Any, _record: Any) -> None:
    # Let us emit BEGIN ourselves (pysqlite's implicit transactions don't cover DDL).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    _enable_wal(cursor)
    cursor.execute("PRAGMA synchronous = FULL")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.close()


def _enable_wal(cursor: Any) -> None:
    """Switch the file to WAL (persistent, so only its first opener really changes it).

    The switch needs the file to itself, and SQLite does not always run the busy handler for
    it: when another process is opening the same fresh file at that moment it answers
    "database is locked" at once. So retry, within the busy timeout.
    """
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if ("locked" not in str(err) and "busy" not in str(err)) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _begin_sqlite_transaction(conn: sa.Connection) -> None:
    write = conn.get_execution_options().get("rollout_write", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _check_status(status: str) -> None:
    if status not in RUN_STATUSES:
        raise StorageError(f"invalid run status {status!r}; expected one of {sorted(RUN_STATUSES)}")


def _read_float(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _snapshot_from_row(row: Any) -> SnapshotRecord:
    values = dict(row)
    values["manifest"] = json.loads(values["manifest"])
    values["metadata"] = json.loads(values["metadata"])
    return SnapshotRecord(**values)


def _first_line(err: sa.exc.SQLAlchemyError) -> str:
    source: object = getattr(err, "orig", None) or err
    lines = str(source).strip().splitlines()
    return lines[0] if lines else type(source).__name__
