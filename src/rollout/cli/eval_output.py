"""What `rollout eval` prints: the progress bar, metric tables, eval listings and comparisons.

Tables are for terminals (rich); scripts get JSON (`describe_eval`, `--json`). Only light imports.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import typer

from rollout.cli.snapshot import RUN_ID_CHARS, format_age, format_time, key_value_table, new_table, plain
from rollout.progress import shows_progress

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from rollout.store.base import EvalRecord

RESUMABLE = frozenset({"crashed", "failed", "cancelled"})
_STATUS_STYLES = {"running": "cyan", "succeeded": "green", "failed": "red", "cancelled": "yellow",
                  "crashed": "bold white on red"}  # fmt: skip


class EvalProgress:
    """A rich bar on a TTY (stderr); otherwise a plain line every ~5% of the samples."""

    def __init__(self, total: int, *, already: int) -> None:
        self.total, self.done, self.tokens = total, already, 0
        self._t0 = time.perf_counter()
        self._every = max(1, total // 20)
        self._next = already + self._every
        self._lock = threading.Lock()
        self._bar: Any = None
        self._shown = shows_progress()
        if self._shown and sys.stderr.isatty() and already < total:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]eval"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=Console(stderr=True),
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("eval", total=total, completed=already, info="")

    def advance(self, samples: int, tokens: int) -> None:
        with self._lock:
            self.done += samples
            self.tokens += tokens
            rate = self.tokens / max(time.perf_counter() - self._t0, 1e-9)
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, info=f"{rate:.0f} tok/s")
            elif self._shown and (self.done >= self._next or self.done == self.total):
                self._next = self.done + self._every
                typer.echo(f"samples={self.done}/{self.total} tokens_per_s={rate:.1f}", err=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def metric_rows(metrics: dict[str, float]) -> list[tuple[str, float, float | None, float | None]]:
    """(name, value, ci_low, ci_high) per metric, CI keys folded into their metric's row."""
    rows = []
    for name, value in metrics.items():
        if name.endswith(("_ci_low", "_ci_high")):
            continue
        rows.append((name, value, metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")))
    return rows


def metrics_table(metrics: dict[str, float], *, title: str) -> Table:
    table = new_table("metric", "value", "95% CI", title=title)
    for column in table.columns[1:]:
        column.justify = "right"
    for name, value, low, high in metric_rows(metrics):
        table.add_row(
            name,
            format_value(value),
            plain("" if low is None else f"[{format_value(low)}, {format_value(high)}]"),
        )
    return table


def format_value(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def describe_eval(record: EvalRecord, stored: int, *, with_config: bool) -> dict[str, Any]:
    described = asdict(record)
    config = json.loads(described.pop("config_json"))
    if with_config:
        described["config"] = config
    described["n_samples_stored"] = stored
    described["n_samples_expected"] = record.n_prompts * record.n
    if record.status in RESUMABLE:
        described["resume_with"] = f"rollout eval --resume {record.id}"
    return described


def status_cell(status: str) -> Text:
    return plain(status, style=_STATUS_STYLES.get(status, ""))


def evals_table(records: list[EvalRecord], counts: dict[str, int]) -> Table:
    columns = ["id", "name", "status", "env", "model", "samples", "pass@1", "age", "duration"]
    table = new_table(*columns)
    for column in table.columns:
        column.no_wrap = column.header not in ("name", "model")
    for name in ("samples", "pass@1", "duration"):
        table.columns[columns.index(name)].justify = "right"
    now = time.time()
    for r in records:
        metrics = (r.summary or {}).get("metrics", {})
        samples = f"{counts.get(r.id, 0)}/{r.n_prompts * r.n}"
        table.add_row(
            r.id[:RUN_ID_CHARS], plain(r.name), status_cell(r.status), plain(r.env), plain(r.model), samples,
            format_value(metrics.get("pass@1")), format_age(r.created_at, now=now), format_duration(r, now=now),
        )  # fmt: skip
    return table


def eval_tables(record: EvalRecord, stored: int) -> list[Table]:
    fields: list[tuple[str, Any]] = [
        ("id", record.id),
        ("name", record.name or ""),
        ("status", status_cell(record.status)),
        ("model", record.model),
        ("engine", record.engine),
        ("env", record.env),
        ("data", f"{record.data_path} (blake3 {str(record.data_digest)[:12]})"),
        ("samples", f"{stored}/{record.n_prompts * record.n} ({record.n_prompts} prompts x {record.n})"),
        ("seed", str(record.seed)),
        ("success", f"reward >= {record.success_threshold:g}"),
        ("sampling", ", ".join(f"{k}={v}" for k, v in sorted(record.sampling.items()))),
        ("created", f"{format_time(record.created_at)} ({format_age(record.created_at)})"),
        ("duration", format_duration(record)),
    ]
    if record.run_id:
        fields.append(("run", f"{record.run_id} step {record.step}"))
    if record.error:
        fields.append(("error", record.error))
    if record.status in RESUMABLE:
        fields.append(("resume with", f"rollout eval --resume {record.id}"))
    tables = [key_value_table(fields, title=f"eval {record.id}")]
    if record.summary:
        tables.append(metrics_table(record.summary.get("metrics", {}), title="metrics"))
    return tables


def comparison_tables(comparison: dict[str, Any]) -> list[Table]:
    a, b = comparison["a"], comparison["b"]
    title = f"B - A over {comparison['n_shared_prompts']} shared prompts (A {a['eval_id']}, B {b['eval_id']})"
    table = new_table("metric", "A", "B", "delta", "95% CI (paired)", title=title)
    for column in table.columns[1:]:
        column.justify = "right"
    for name, entry in comparison["metrics"].items():
        ci = (
            ""
            if entry["ci_low"] is None
            else f"[{format_value(entry['ci_low'])}, {format_value(entry['ci_high'])}]"
        )
        delta = entry["delta"]
        table.add_row(
            name,
            format_value(entry["a"]),
            format_value(entry["b"]),
            "" if delta is None else f"{delta:+.4g}",
            plain(ci),
        )
    flips = new_table("flipped", "count", "prompts", title="prompts that flipped")
    flips.columns[1].justify = "right"
    for kind, prompts in comparison["flipped"].items():
        shown = ", ".join(map(str, prompts[:20])) + (" …" if len(prompts) > 20 else "")
        flips.add_row(kind, str(len(prompts)), shown)
    return [table, flips]


def format_duration(record: EvalRecord, *, now: float | None = None) -> str:
    seconds = (record.timings or {}).get("wall_s")
    if seconds is None:
        if record.started_at is None:
            return ""
        end = record.ended_at if record.ended_at is not None else (time.time() if now is None else now)
        seconds = end - record.started_at
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
