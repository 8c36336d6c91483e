"""The eval tables of `SqlStore`: their migration and the statements behind the store's eval methods.

`evals` holds one row per `rollout eval` (its parameters, status and summary);
`eval_samples` one row per scored sample, keyed by (eval_id, prompt_index,
sample_index) so a resumed eval can never store a sample twice: inserts skip
rows that exist. `SqlStore` wraps each function here in its transaction and
error handling; the functions take a connection and plain values.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from ulid import ULID

from rollout.errors import EvalNotFound
from rollout.store.base import EVAL_SAMPLE_FIELDS, TERMINAL_RUN_STATUSES, EvalRecord, EvalSampleRecord

# Appended to `sql.MIGRATIONS` (version 3). DDL valid on SQLite and PostgreSQL.
EVAL_TABLES_MIGRATION: tuple[str, ...] = (
    """CREATE TABLE evals (
        id TEXT PRIMARY KEY,
        name TEXT,
        status TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        started_at DOUBLE PRECISION,
        ended_at DOUBLE PRECISION,
        heartbeat_at DOUBLE PRECISION,
        model TEXT NOT NULL,
        model_identity TEXT,
        engine TEXT NOT NULL,
        env TEXT NOT NULL,
        data_path TEXT,
        data_digest TEXT,
        n_prompts BIGINT NOT NULL,
        n BIGINT NOT NULL,
        seed BIGINT NOT NULL,
        success_threshold DOUBLE PRECISION NOT NULL,
        sampling TEXT NOT NULL,
        config_json TEXT NOT NULL,
        run_id TEXT REFERENCES runs (id),
        step BIGINT,
        summary TEXT,
        timings TEXT,
        error TEXT)""",
    "CREATE INDEX ix_evals_created_at ON evals (created_at)",
    "CREATE INDEX ix_evals_run_step ON evals (run_id, step)",
    """CREATE TABLE eval_samples (
        eval_id TEXT NOT NULL REFERENCES evals (id),
        prompt_index BIGINT NOT NULL,
        sample_index BIGINT NOT NULL,
        seed BIGINT NOT NULL,
        reward DOUBLE PRECISION,
        success BOOLEAN NOT NULL,
        failed BOOLEAN NOT NULL,
        answer TEXT,
        completion TEXT,
        messages TEXT NOT NULL,
        turns BIGINT NOT NULL,
        tool_calls BIGINT NOT NULL,
        finish_reason TEXT,
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        truncated BOOLEAN NOT NULL,
        error TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (eval_id, prompt_index, sample_index))""",
)

_EVAL_COLUMNS = tuple(EvalRecord.__dataclass_fields__)
_JSON_COLUMNS = ("sampling", "summary", "timings")
evals = sa.table("evals", *(sa.column(c) for c in _EVAL_COLUMNS))
eval_samples = sa.table("eval_samples", *(sa.column(c) for c in ("eval_id", *EVAL_SAMPLE_FIELDS)))
_ULID_PREFIX = re.compile(r"[0-9A-HJKMNP-TV-Z]{10,25}")  # Crockford base32; 10 chars = the time part
_IN_CHUNK = 500

InsertFactory = Callable[[sa.TableClause], Any]
"""The dialect's `insert(table)` (it has `on_conflict_do_nothing`)."""


def new_eval_record(**values: Any) -> EvalRecord:
    """A fresh `pending` eval with a ULID id and the given parameters."""
    return EvalRecord(
        id=str(ULID()),
        status="pending",
        created_at=time.time(),
        started_at=None,
        ended_at=None,
        heartbeat_at=None,
        **values,
    )


def insert_eval(conn: sa.Connection, record: EvalRecord) -> None:
    row = {name: getattr(record, name) for name in _EVAL_COLUMNS}
    for name in _JSON_COLUMNS:
        row[name] = None if row[name] is None else _dump(row[name])
    conn.execute(evals.insert().values(**row))


def update_eval_status(
    conn: sa.Connection,
    eval_id: str,
    status: str,
    *,
    error: str | None,
    summary: dict | None,
    timings: dict | None,
) -> int:
    """The number of rows updated (0: no such eval)."""
    now = time.time()
    values: dict[str, Any] = {"status": status}
    if status == "running":
        values.update(
            started_at=sa.func.coalesce(evals.c.started_at, now), heartbeat_at=now, ended_at=None, error=None
        )
    if status in TERMINAL_RUN_STATUSES:
        values["ended_at"] = now
    if error is not None:
        values["error"] = error
    if summary is not None:
        values["summary"] = _dump(summary)
    if timings is not None:
        values["timings"] = _dump(timings)
    return conn.execute(evals.update().where(evals.c.id == eval_id).values(**values)).rowcount


def stamp_eval_heartbeat(conn: sa.Connection, eval_id: str) -> bool:
    statement = (
        evals.update()
        .where(evals.c.id == eval_id, evals.c.status == "running")
        .values(heartbeat_at=time.time())
    )
    return conn.execute(statement).rowcount > 0


def stale_evals_clause(timeout_s: float) -> tuple[sa.ColumnElement[bool], sa.ColumnElement[Any]]:
    """(WHERE clause of running evals silent for `timeout_s`, their last sign of life)."""
    last_alive = sa.func.coalesce(evals.c.heartbeat_at, evals.c.started_at, evals.c.created_at)
    return sa.and_(evals.c.status == "running", last_alive < time.time() - timeout_s), last_alive


def any_stale_eval(conn: sa.Connection, timeout_s: float) -> bool:
    stale, _ = stale_evals_clause(timeout_s)
    return conn.execute(sa.select(evals.c.id).where(stale).limit(1)).first() is not None


def crash_stale_evals(conn: sa.Connection, timeout_s: float) -> list[str]:
    """Mark stale running evals `crashed` (re-checked row by row under the write lock)."""
    stale, last_alive = stale_evals_clause(timeout_s)
    statement = (
        evals.update()
        .where(stale)
        .values(
            status="crashed", ended_at=last_alive, error=f"no heartbeat for {timeout_s:g} s (process died?)"
        )
        .returning(evals.c.id)
    )
    return sorted(eval_id for (eval_id,) in conn.execute(statement))


def select_eval(conn: sa.Connection, eval_id: str) -> EvalRecord:
    """By full id, a unique prefix of >= 10 chars (any case), or a `--name` label (its newest eval).

    Else `EvalNotFound`. Ids win: a name is looked up only when no id matches.
    """
    row = conn.execute(sa.select(evals).where(evals.c.id == eval_id)).mappings().first()
    prefix = eval_id.strip().upper()
    if row is None and _ULID_PREFIX.fullmatch(prefix):
        query = (
            sa.select(evals)
            .where(evals.c.id >= prefix, evals.c.id <= prefix + "Z" * (26 - len(prefix)))
            .limit(2)
        )
        rows = conn.execute(query).mappings().all()
        if len(rows) > 1:
            raise EvalNotFound(
                f"eval not found: {eval_id} is an ambiguous prefix (matches several evals)",
                details=["give more characters of the id"],
            )
        row = rows[0] if rows else None
    if row is None:
        named = sa.select(evals).where(evals.c.name == eval_id)
        row = conn.execute(named.order_by(evals.c.created_at.desc(), evals.c.id.desc()).limit(1)).mappings().first()
    if row is None:
        raise EvalNotFound(f"eval not found: {eval_id} (neither an eval id, a unique id prefix nor an eval name)")
    return _eval_from_row(row)


def select_evals(
    conn: sa.Connection, *, limit: int | None, status: str | None, run_id: str | None
) -> list[EvalRecord]:
    query = sa.select(evals).order_by(evals.c.created_at.desc(), evals.c.id.desc()).limit(limit)
    if status is not None:
        query = query.where(evals.c.status == status)
    if run_id is not None:
        query = query.where(evals.c.run_id == run_id)
    return [_eval_from_row(row) for row in conn.execute(query).mappings()]


def insert_eval_samples(
    conn: sa.Connection, insert: InsertFactory, eval_id: str, samples: Sequence[EvalSampleRecord]
) -> None:
    """Insert the samples; one already stored (same prompt and sample index) is left as it is."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for s in samples:  # first one wins inside a batch too (PostgreSQL refuses a row twice per statement)
        rows.setdefault((s.prompt_index, s.sample_index), _sample_row(eval_id, s))
    statement = insert(eval_samples).on_conflict_do_nothing(
        index_elements=["eval_id", "prompt_index", "sample_index"]
    )
    conn.execute(statement, list(rows.values()))


def select_eval_samples(conn: sa.Connection, eval_id: str) -> list[EvalSampleRecord]:
    query = (
        sa.select(eval_samples)
        .where(eval_samples.c.eval_id == eval_id)
        .order_by(eval_samples.c.prompt_index, eval_samples.c.sample_index)
    )
    return [_sample_from_row(row) for row in conn.execute(query).mappings()]


def count_samples(conn: sa.Connection, eval_ids: Sequence[str]) -> dict[str, int]:
    unique = sorted(set(eval_ids))
    counts: dict[str, int] = {}
    for start in range(0, len(unique), _IN_CHUNK):
        chunk = unique[start : start + _IN_CHUNK]
        query = (
            sa.select(eval_samples.c.eval_id, sa.func.count())
            .where(eval_samples.c.eval_id.in_(chunk))
            .group_by(eval_samples.c.eval_id)
        )
        counts.update({eval_id: int(count) for eval_id, count in conn.execute(query)})
    return counts


# --------------------------------------------------------------------------- rows


def _dump(obj: object) -> str:
    # Key order kept (a summary's metrics are in display order); NaN allowed (Python's json reads it back).
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


def _sample_row(eval_id: str, s: EvalSampleRecord) -> dict[str, Any]:
    row = {name: getattr(s, name) for name in EVAL_SAMPLE_FIELDS}
    row.update(
        eval_id=eval_id,
        messages=_dump(s.messages),
        success=bool(s.success),
        failed=bool(s.failed),
        truncated=bool(s.truncated),
    )
    return row


def _sample_from_row(row: Any) -> EvalSampleRecord:
    values = {name: row[name] for name in EVAL_SAMPLE_FIELDS}
    values["messages"] = json.loads(values["messages"])
    for name in ("success", "failed", "truncated"):
        values[name] = bool(values[name])  # SQLite hands back 0/1
    values["reward"] = None if values["reward"] is None else float(values["reward"])
    return EvalSampleRecord(**values)


def _eval_from_row(row: Any) -> EvalRecord:
    values = dict(row)
    for name in _JSON_COLUMNS:
        values[name] = None if values[name] is None else json.loads(values[name])
    return EvalRecord(**values)
