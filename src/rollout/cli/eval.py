"""`rollout eval`: evaluate a model folder, a snapshot or an endpoint on an env; list, show, compare evals.

    rollout eval --env arithmetic --data data/arith/eval_prompts.jsonl --model models/sft-tiny --n 8 --k 1,4,8
    rollout eval --env math --data math.jsonl --base-url http://127.0.0.1:8000/v1 --n 4 --temperature 0.6
    rollout eval --env arithmetic --data eval.jsonl --snapshot 3f2a9c1e --json
    rollout eval --config eval.toml                       # an [eval] table with the same fields as the flags
    rollout eval --resume 01J8ABCDEF                      # after a crash or kill -9: only what is missing
    rollout eval list | show ID | compare ID_A ID_B

Every sample is a row in the store (written as it finishes) and, with `--output`, a JSON
line. Storage: `--dsn` or `--storage-path`, then the config's `[storage]` table, then
`$ROLLOUT_STORAGE_PATH`, then ./rollout.db (created by an eval, never by list/show/compare).
Only light imports here: torch loads after the arguments are parsed, and only for `--model`
or `--snapshot` (an endpoint eval never imports it); the eval config models and the store
load inside the commands too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout.cli.eval_output import (
    EvalProgress,
    comparison_tables,
    describe_eval,
    eval_tables,
    evals_table,
    format_value,
    metric_rows,
    metrics_table,
)
from rollout.cli.runs import DEFAULT_HEARTBEAT_TIMEOUT_S
from rollout.cli.snapshot import (
    DEFAULT_OBJECT_PATH,
    DEFAULT_STORAGE_PATH,
    JsonOption,
    StorageFlags,
    format_age,
    print_json,
    print_tables,
    wants_json,
)
from rollout.errors import ConfigError, StorageError

if TYPE_CHECKING:  # imported by the commands that use them (eval.harness, eval.compare, rl.envs load asyncio)
    from rollout.config import StorageConfig
    from rollout.eval.config import EvalConfig
    from rollout.eval.harness import EvalData
    from rollout.eval.metrics import EvalSummary
    from rollout.inference.types import InferenceEngine
    from rollout.store import Store
    from rollout.store.base import EvalRecord, EvalSampleRecord

app = typer.Typer(
    help="Evaluate a model, snapshot or endpoint on an env: N samples per prompt, pass@k, pass^k, maj@k,"
    " avg@k with bootstrap CIs, every sample stored, resumable.\n\n"
    "Run an eval:  rollout eval --env NAME --data F.jsonl (--model DIR | --snapshot ID | --base-url URL)"
    " [--n N] [--k 1,4,8] ...\n\n"
    "or from a file:  rollout eval --config eval.toml   (an `eval` table with the same fields)\n\n"
    "Continue one that stopped:  rollout eval --resume EVAL_ID\n\n"
    "Look at evals:  rollout eval list | show EVAL_ID | compare EVAL_A EVAL_B",
    invoke_without_command=True,
)

_RUN = "Run an eval"
_STORE = "Storage"

StoragePath = Annotated[
    Path | None,
    typer.Option("--storage-path", help="SQLite store (default $ROLLOUT_STORAGE_PATH or ./rollout.db).",
                 rich_help_panel=_STORE),
]  # fmt: skip
ObjectPath = Annotated[
    Path | None,
    typer.Option("--object-path", help="Object store, for --snapshot (default $ROLLOUT_OBJECT_PATH or"
                 " ./object-store).", rich_help_panel=_STORE),
]  # fmt: skip
Dsn = Annotated[
    str | None,
    typer.Option("--dsn", help="PostgreSQL DSN; used instead of --storage-path.", rich_help_panel=_STORE),
]
Config = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML with an `eval` table (flags override it) and optionally `storage`.",
                 rich_help_panel=_STORE),
]  # fmt: skip


HeartbeatTimeoutOption = Annotated[
    float,
    typer.Option(
        "--heartbeat-timeout",
        envvar="ROLLOUT_HEARTBEAT_TIMEOUT",
        min=0.1,
        metavar="SECONDS",
        help="A running eval silent for this long is marked crashed (so --resume may take it over).",
        rich_help_panel=_STORE,
    ),
]


def _opt(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=_RUN, **kw)


@app.callback()
def eval_command(
    ctx: typer.Context,
    env: Annotated[str | None, _opt("--env", help="Built-in env (arithmetic, math) or module:attr.")] = None,
    data: Annotated[Path | None, _opt("--data", help='JSONL of {"prompt", ...} rows.')] = None,
    model: Annotated[str | None, _opt("--model", "-m", help="Model folder (hf engine, in-process).")] = None,
    snapshot: Annotated[str | None, _opt("--snapshot", help="train_state snapshot id (>= 8 hex).")] = None,
    base_url: Annotated[str | None, _opt("--base-url", help="OpenAI-compatible endpoint (…/v1).")] = None,
    served_model: Annotated[
        str | None, _opt("--served-model", help="Model name at --base-url (default its first).")
    ] = None,
    api_key: Annotated[
        str | None, _opt("--api-key", envvar="OPENAI_API_KEY", help="Bearer key for --base-url.")
    ] = None,
    n: Annotated[int | None, _opt("--n", min=1, help="Samples per prompt (default 1).")] = None,
    temperature: Annotated[
        float | None, _opt("--temperature", min=0, help="0 is greedy (default 1.0).")
    ] = None,
    top_p: Annotated[float | None, _opt("--top-p", help="Nucleus mass in (0, 1] (default 1.0).")] = None,
    max_tokens: Annotated[
        int | None, _opt("--max-tokens", min=1, help="Per assistant turn (default 256).")
    ] = None,
    max_turns: Annotated[int | None, _opt("--max-turns", min=1, help="Per episode (default 8).")] = None,
    seed: Annotated[int | None, _opt("--seed", min=0, help="Base seed (default 0).")] = None,
    success_threshold: Annotated[
        float | None, _opt("--success-threshold", help="Success: reward >= this (default 1.0).")
    ] = None,
    k: Annotated[
        str | None, _opt("--k", metavar="K,K,...", help="pass@k etc. for these k (default 1,2,4,…<=n).")
    ] = None,
    output: Annotated[
        Path | None, _opt("--output", "-o", help="Also write one JSON line per sample.")
    ] = None,
    name: Annotated[str | None, _opt("--name", help="A label for `eval list`.")] = None,
    max_concurrency: Annotated[
        int | None, _opt("--max-concurrency", min=1, help="Endpoint: requests in flight.")
    ] = None,
    max_attempts: Annotated[
        int | None, _opt("--max-attempts", min=1, help="Tries per request (default 4).")
    ] = None,
    request_timeout: Annotated[
        float | None,
        _opt("--request-timeout", min=0.001, help="Endpoint: seconds per request (default 120)."),
    ] = None,
    threads: Annotated[int | None, _opt("--threads", min=1, help="hf on CPU: torch threads.")] = None,
    resume: Annotated[
        str | None, _opt("--resume", metavar="EVAL_ID", help="Continue a stopped eval (id or unique prefix).")
    ] = None,
    as_json: Annotated[
        bool, _opt("--json", help='Print {"eval_id", "n_prompts", "n_samples", "metrics"}.')
    ] = False,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    config: Config = None,
    storage_path: StoragePath = None,
    object_path: ObjectPath = None,
    dsn: Dsn = None,
) -> None:
    """Evaluate a model, snapshot or endpoint on an env (see `rollout eval --help`)."""
    given = {
        "env": env, "data": data, "model": model, "snapshot": snapshot, "base_url": base_url,
        "served_model": served_model, "n": n, "temperature": temperature, "top_p": top_p,
        "max_tokens": max_tokens, "max_turns": max_turns, "seed": seed, "success_threshold": success_threshold,
        "k": _parse_ks(k), "output": output, "name": name, "max_concurrency": max_concurrency,
        "max_attempts": max_attempts, "request_timeout_s": request_timeout, "threads": threads,
    }  # fmt: skip
    given = {key: value for key, value in given.items() if value is not None}
    if ctx.invoked_subcommand is not None:
        if given or resume or as_json:
            raise ConfigError(
                f"`rollout eval {ctx.invoked_subcommand}` takes its own options; put them after it"
            )
        return
    if not given and resume is None and config is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    flags = StorageFlags(storage_path, object_path, dsn, config)
    if resume is not None:
        _resume(
            resume, given, api_key=api_key, flags=flags, as_json=as_json, heartbeat_timeout=heartbeat_timeout
        )
    else:
        _start(given, api_key=api_key, flags=flags, as_json=as_json)


TableOption = Annotated[
    bool, typer.Option("--table", help="Print tables even when stdout is not a terminal (a log, a pipe).")
]


@app.command("list")
def list_command(
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many evals.")] = None,
    status: Annotated[
        str | None,
        typer.Option("--status", help="pending | running | succeeded | failed | cancelled | crashed"),
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Only evals of this training run.")] = None,
    as_json: JsonOption = False,
    as_table: TableOption = False,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    config: Config = None,
    storage_path: StoragePath = None,
    dsn: Dsn = None,
) -> None:
    """List evals, newest first: a table on a terminal (or with --table), else a JSON array."""
    _one_format(as_json, as_table)
    with _open_store(StorageFlags(storage_path, None, dsn, config), create=False) as store:
        store.mark_crashed_evals(timeout_s=heartbeat_timeout)
        records = store.list_evals(limit=limit, status=status, run_id=run_id)
        counts = store.count_eval_samples([r.id for r in records])
    if wants_json(as_json) and not as_table:
        print_json([describe_eval(r, counts.get(r.id, 0), with_config=False) for r in records])
    else:
        print_tables(evals_table(records, counts))


@app.command("show")
def show_command(
    eval_id: Annotated[
        str,
        typer.Argument(metavar="EVAL_ID", help="Eval id, a unique prefix (>= 10 chars) or a --name (its newest)."),
    ],
    as_json: JsonOption = False,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    config: Config = None,
    storage_path: StoragePath = None,
    dsn: Dsn = None,
) -> None:
    """Show one eval: parameters, status, metrics with CIs; tables on a terminal, else JSON."""
    with _open_store(StorageFlags(storage_path, None, dsn, config), create=False) as store:
        store.mark_crashed_evals(timeout_s=heartbeat_timeout)
        record = store.get_eval(eval_id)
        stored = store.count_eval_samples([record.id]).get(record.id, 0)
    if wants_json(as_json):
        print_json(describe_eval(record, stored, with_config=True))
    else:
        print_tables(*eval_tables(record, stored))


@app.command("compare")
def compare_command(
    eval_a: Annotated[str, typer.Argument(metavar="EVAL_A", help="The baseline eval: id, prefix or --name.")],
    eval_b: Annotated[
        str, typer.Argument(metavar="EVAL_B", help="The eval compared with it (deltas are B - A).")
    ],
    as_json: JsonOption = False,
    as_table: TableOption = False,
    config: Config = None,
    storage_path: StoragePath = None,
    dsn: Dsn = None,
) -> None:
    """Per-metric deltas B - A with paired-bootstrap CIs over shared prompts, and the prompts that flipped."""
    _one_format(as_json, as_table)
    from rollout.eval.compare import compare_evals

    with _open_store(StorageFlags(storage_path, None, dsn, config), create=False) as store:
        a, b = store.get_eval(eval_a), store.get_eval(eval_b)
        comparison = compare_evals(a, store.read_eval_samples(a.id), b, store.read_eval_samples(b.id))
    if not comparison["same_data"]:
        typer.echo("warning: the two evals ran on different data; prompts are paired by index", err=True)
    if wants_json(as_json) and not as_table:
        print_json(comparison)
    else:
        print_tables(*comparison_tables(comparison))


def _one_format(as_json: bool, as_table: bool) -> None:
    if as_json and as_table:
        raise ConfigError("--json and --table exclude each other: give one")


# --------------------------------------------------------------------------- running


def _start(given: dict[str, Any], *, api_key: str | None, flags: StorageFlags, as_json: bool) -> None:
    from rollout.eval.config import TARGET_FIELDS, build_eval_config, read_eval_table
    from rollout.eval.harness import (
        check_rows_with_env,
        create_eval_record,
        load_engine,
        load_eval_data,
        resolve_target,
    )
    from rollout.rl.envs import resolve_env

    targets = [f"--{name.replace('_', '-')}" for name in TARGET_FIELDS if name in given]
    if len(targets) > 1:
        raise ConfigError(f"give one of --model, --snapshot or --base-url, not {' and '.join(targets)}")
    for key in ("model", "output"):  # flags are relative to the cwd (--data stays as typed, for messages)
        if key in given:
            given[key] = Path(given[key]).expanduser().resolve()
    if "model" in given:
        given["model"] = str(given["model"])
    table: dict[str, Any] = {}
    text = None
    if flags.config is not None:
        table, text, _ = read_eval_table(flags.config)
        if targets:  # a target flag replaces the file's target
            table = {k: v for k, v in table.items() if k not in (*TARGET_FIELDS, "served_model")}
    cfg = build_eval_config({**table, **given}, source=flags.config, text=text)
    env_factory = resolve_env(cfg.env)
    data = load_eval_data(cfg, env_factory)  # every line checked before a model loads...
    check_rows_with_env(data, env_factory)  # ...and accepted by the env
    objects = _object_path(flags)
    with _open_store(flags, create=True) as store, ExitStack() as stack:
        target = resolve_target(cfg, api_key=api_key, store=store, object_path=objects)
        engine = load_engine(target, cfg, stack, store=store, object_path=objects)
        record = create_eval_record(store, cfg, target, data)
        _announce(record, cfg, resumed=0)
        summary = _execute(store, record, cfg, engine, data, previous=[])
    _print_result(record, summary, as_json=as_json)


def _resume(
    eval_id: str,
    given: dict[str, Any],
    *,
    api_key: str | None,
    flags: StorageFlags,
    as_json: bool,
    heartbeat_timeout: float,
) -> None:
    from rollout.eval.config import EvalConfig, build_eval_config
    from rollout.eval.harness import check_resume, load_engine, load_eval_data, resolve_target
    from rollout.rl.envs import resolve_env

    fixed = sorted(set(given) - {"data", "output"})
    if fixed:
        names = ", ".join(f"--{key.replace('_', '-')}" for key in fixed)
        raise ConfigError(
            f"--resume runs with the eval's recorded parameters; drop {names}",
            details=["only --data (the same file, moved), --output and --api-key go with --resume"],
        )
    objects = _object_path(flags)
    with _open_store(flags, create=False) as store, ExitStack() as stack:
        store.mark_crashed_evals(timeout_s=heartbeat_timeout)
        record = store.get_eval(eval_id)
        if record.status == "running":
            raise StorageError(
                f"eval {record.id} is still running (last heartbeat {format_age(record.heartbeat_at)})",
                details=[
                    "if its process is gone, retry once its heartbeat is older than --heartbeat-timeout"
                    f" ({heartbeat_timeout:g} s)"
                ],
            )
        if record.run_id is not None:  # its model was the live policy at that step: nothing to reload
            raise ConfigError(
                f"eval {record.id} ran during training run {record.run_id} (step {record.step}); it can't be resumed",
                details=["evaluate a snapshot of the run instead: rollout eval --snapshot ID ..."],
            )
        recorded = EvalConfig.model_validate_json(record.config_json).model_dump()
        recorded.update(
            {key: Path(given[key]).expanduser().resolve() for key in ("data", "output") if key in given}
        )
        cfg = build_eval_config(recorded)
        data = load_eval_data(cfg, resolve_env(cfg.env))
        target = resolve_target(cfg, api_key=api_key, store=store, object_path=objects)
        check_resume(record, data, target)
        previous = store.read_eval_samples(record.id)
        missing = len(data.rows) * cfg.n - len(previous)
        engine = load_engine(target, cfg, stack, store=store, object_path=objects) if missing else None
        _announce(record, cfg, resumed=len(previous))
        summary = _execute(store, record, cfg, engine, data, previous=previous)
    _print_result(record, summary, as_json=as_json)


def _execute(
    store: Store,
    record: EvalRecord,
    cfg: EvalConfig,
    engine: InferenceEngine | None,
    data: EvalData,
    *,
    previous: list[EvalSampleRecord],
) -> EvalSummary:
    from rollout.eval.harness import execute_eval

    progress = EvalProgress(len(data.rows) * cfg.n, already=len(previous))
    try:
        summary = execute_eval(
            store,
            record,
            cfg,
            engine,
            data,
            previous=previous,
            output=cfg.output,
            on_progress=progress.advance,
        )
    finally:
        progress.close()
    failed = int(summary.metrics.get("n_failed", 0))
    if failed:
        first = next((s.error for s in store.read_eval_samples(record.id) if s.failed), None)
        typer.echo(
            f"warning: {failed} of {summary.n_samples} samples failed (first error: {first})", err=True
        )
    return summary


def _announce(record: EvalRecord, cfg: EvalConfig, *, resumed: int) -> None:
    total = record.n_prompts * record.n
    what = f"resuming eval {record.id} ({resumed}/{total} samples stored)" if resumed else f"eval {record.id}"
    typer.echo(
        f"{what}: env {record.env}, {record.n_prompts} prompts x {record.n} samples, model {record.model}"
        f" (resume with: rollout eval --resume {record.id})",
        err=True,
    )


def _print_result(record: EvalRecord, summary: EvalSummary, *, as_json: bool) -> None:
    """`--json`: one object; a terminal: a table of metrics with CIs; a pipe: one plain line per metric."""
    if as_json:
        result = {"eval_id": record.id, "n_prompts": summary.n_prompts, "n_samples": summary.n_samples}
        print_json({**result, "metrics": summary.metrics})
    elif sys.stdout.isatty():
        title = f"eval {record.id}: {summary.n_prompts} prompts x {record.n} samples"
        print_tables(metrics_table(summary.metrics, title=title))
    else:
        typer.echo(f"eval {record.id} n_prompts={summary.n_prompts} n_samples={summary.n_samples}")
        for name, value, low, high in metric_rows(summary.metrics):
            ci = "" if low is None else f" [{format_value(low)}, {format_value(high)}]"
            typer.echo(f"{name} {format_value(value)}{ci}")


def _parse_ks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ks = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ConfigError(f"--k: expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise ConfigError(f"--k: every k must be >= 1, got {text!r}")
    return ks


# --------------------------------------------------------------------------- storage


def _storage_config(flags: StorageFlags) -> StorageConfig | None:
    """The `[storage]` table of the `--config` file, or None (an eval file needs no other table)."""
    from rollout.eval.config import read_storage_config

    return None if flags.config is None else read_storage_config(flags.config)


@contextmanager
def _open_store(flags: StorageFlags, *, create: bool) -> Iterator[Store]:
    """The store the flags name; an eval creates a missing SQLite file, list/show/compare don't."""
    from rollout.store import open_store

    dsn, path = flags.dsn, flags.storage_path
    if dsn is None and path is None:
        storage = _storage_config(flags)
        if storage is not None and storage.backend == "postgres":
            assert storage.postgres is not None  # StorageConfig checks it
            dsn = storage.postgres.dsn
        elif storage is not None:
            path = storage.embedded.path
        else:
            path = Path(os.environ.get("ROLLOUT_STORAGE_PATH") or DEFAULT_STORAGE_PATH)
    if dsn is not None:
        store = open_store("postgres", dsn=dsn)
    else:
        assert path is not None
        if not create and not path.is_file():
            raise StorageError(f"no store at {path}", details=["pass --storage-path, --dsn or --config"])
        store = open_store("embedded", path=path)
    try:
        yield store
    finally:
        store.close()


def _object_path(flags: StorageFlags) -> Path:
    if flags.object_path is not None:
        return flags.object_path
    storage = _storage_config(flags)
    if storage is not None:
        return Path(storage.objects.path)
    return Path(os.environ.get("ROLLOUT_OBJECT_PATH") or DEFAULT_OBJECT_PATH)
