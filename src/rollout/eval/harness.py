"""From an `EvalConfig` to a stored, summarised eval: check inputs, load the engine, run, resume, finish.

    data = load_eval_data(cfg, env_factory)                     # every line checked (file:line on error)
    target = resolve_target(cfg, api_key=None, store=store, object_path=objects)   # cheap: no model load
    with ExitStack() as stack:
        engine = load_engine(target, cfg, stack)                # the heavy part (torch, weights)
        record = create_eval_record(store, cfg, target, data)
        summary = execute_eval(store, record, cfg, engine, data, previous=[])

`rollout eval` (cli/eval.py) is a thin shell over these; `--resume` calls `check_resume`,
reads the stored samples and passes them as `previous`. The store is the truth: samples are
written as they finish (in batches), and the summary is computed from the stored rows, so an
interrupted-then-resumed eval ends with exactly the rows and metrics of an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3

from rollout.data.jsonl import read_rows
from rollout.errors import ConfigError, DataError, ModelError, RolloutError, StorageError
from rollout.eval.config import EvalConfig
from rollout.eval.fields import env_label
from rollout.eval.metrics import EvalSummary
from rollout.eval.runner import run_eval, summarize_samples, summary_to_dict
from rollout.export import export_snapshot
from rollout.inference.models import digest_model_dir
from rollout.inference.sampler import EngineSampler, RetryPolicy
from rollout.inference.types import InferenceEngine, SamplingParams
from rollout.observe import heartbeat_interval_s
from rollout.rl.envs import resolve_env
from rollout.rl.types import EnvFactory
from rollout.store import open_object_store
from rollout.store.base import EvalRecord, EvalSampleRecord, Store

ProgressFn = Callable[[int, int], None]
"""(samples just written, their completion tokens)."""
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EvalData:
    """The prompt rows, where they came from (file, 1-based line of each row), the file's blake3."""

    path: Path
    digest: str
    rows: list[dict[str, Any]]
    lines: list[int] | None = None


@dataclass(frozen=True)
class Target:
    """What is evaluated, resolved but not loaded."""

    engine: Literal["hf", "openai"]
    description: str  # what `eval list` shows: a folder, snapshot:<id>, or "<url> <served name>"
    identity: str | None  # files:<blake3> | snapshot:<id> | openai:<url>:<name>
    model_path: Path | None = None  # hf folder
    snapshot_id: str | None = None
    base_url: str | None = None
    served_model: str | None = None
    api_key: str | None = None


# --------------------------------------------------------------------------- inputs


def load_eval_data(cfg: EvalConfig, env_factory: EnvFactory, *, path: Path | None = None) -> EvalData:
    """Read and check every prompt row (`DataError` naming `file:line`); `path` overrides `cfg.data`."""
    path = path or cfg.data or getattr(env_factory, "default_data", None)
    if path is None:
        raise ConfigError(f"no data: pass --data (the env {env_label(cfg.env)!r} has no default data)")
    path = Path(path)
    rows, _ = read_rows(path, "prompt")
    return EvalData(path, digest_file(path), [row.data for row in rows], [row.line for row in rows])


def check_rows_with_env(data: EvalData, env_factory: EnvFactory) -> None:
    """Start an episode on every row (`env.reset`) so a row the env can't use stops us before any model loads.

    An env's own complaint (a `RolloutError`, e.g. a missing "answer") becomes `file:line: ...`.
    """

    async def reset_all() -> None:
        for i, row in enumerate(data.rows):
            try:
                await env_factory().reset(row)
            except RolloutError as err:
                line = data.lines[i] if data.lines else i + 1
                raise DataError(f"{data.path}:{line}: {err}", details=err.details) from None

    asyncio.run(reset_all())


def digest_file(path: Path) -> str:
    hasher = blake3.blake3()
    try:
        hasher.update_mmap(path)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None
    return hasher.hexdigest()


def resolve_target(
    cfg: EvalConfig, *, api_key: str | None, store: Store | None, object_path: Path | None
) -> Target:
    """Check the target exists and answers, without loading a model (exit-2 errors come here)."""
    if cfg.model is not None:
        path = Path(cfg.model)
        if not (path / "config.json").is_file():
            raise ModelError(f"{cfg.model}: not a model folder (no config.json)")
        return Target("hf", str(path), f"files:{digest_model_dir(path)}", model_path=path)
    if cfg.snapshot is not None:
        if store is None or object_path is None:
            raise StorageError("--snapshot needs the store and object store the snapshot lives in")
        record = store.get_snapshot(cfg.snapshot)
        if record.kind != "train_state":
            raise StorageError(
                f"snapshot {record.id[:12]} is a {record.kind} snapshot; only train_state holds a model"
            )
        if not object_path.is_dir():
            raise StorageError(
                f"no object store at {object_path}", details=["pass --object-path or --config"]
            )
        return Target("hf", f"snapshot:{record.id}", f"snapshot:{record.id}", snapshot_id=record.id)
    assert cfg.base_url is not None  # EvalConfig checks exactly one target is set
    url = cfg.base_url.rstrip("/")
    served = probe_endpoint(url, api_key=api_key, model=cfg.served_model)
    return Target(
        "openai",
        f"{url} {served}",
        f"openai:{url}:{served}",
        base_url=url,
        served_model=served,
        api_key=api_key,
    )


def probe_endpoint(base_url: str, *, api_key: str | None, model: str | None) -> str:
    """GET {base_url}/models: the endpoint answers, and serves `model` (default: its first model)."""
    headers = {"Authorization": f"Bearer {api_key or os.environ.get('OPENAI_API_KEY') or 'EMPTY'}"}
    request = urllib.request.Request(f"{base_url}/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            listed = [str(m.get("id")) for m in json.loads(response.read() or b"{}").get("data", [])]
    except urllib.error.HTTPError as err:
        hint = ["pass --api-key (or set OPENAI_API_KEY)"] if err.code in (401, 403) else []
        raise ModelError(f"endpoint {base_url} refused GET /models: HTTP {err.code}", details=hint) from None
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as err:
        reason = getattr(err, "reason", err)
        raise ModelError(f"cannot reach endpoint {base_url}: {reason}") from None
    if model is None:
        if not listed:
            raise ModelError(f"endpoint {base_url} lists no model; pass --served-model")
        return listed[0]
    if listed and model not in listed:
        raise ModelError(f"endpoint {base_url} does not serve {model!r} (it serves: {', '.join(listed)})")
    return model


def load_engine(
    target: Target,
    cfg: EvalConfig,
    stack: ExitStack,
    *,
    store: Store | None = None,
    object_path: Path | None = None,
) -> InferenceEngine:
    """The engine for `target`; closed (and a snapshot's temp export deleted) when `stack` closes."""
    if target.engine == "openai":
        from rollout.inference.openai_engine import OpenAIEngine

        assert target.base_url is not None and target.served_model is not None
        engine: InferenceEngine = OpenAIEngine(
            base_url=target.base_url,
            model_name=target.served_model,
            api_key=target.api_key,
            max_concurrency=cfg.max_concurrency,
            timeout_s=cfg.request_timeout_s,
            max_retries=0,  # we retry, with the configured backoff, and count the failures
        )
    else:
        import torch

        from rollout.inference.hf_engine import load_hf_engine

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        path = target.model_path
        if target.snapshot_id is not None:
            path = _export_snapshot(target.snapshot_id, stack, store=store, object_path=object_path)
        assert path is not None
        engine = load_hf_engine(
            path, dtype=cfg.dtype, device=cfg.device, max_batch_size=cfg.max_batch_size, model_name=path.name
        )
    stack.callback(engine.close)
    return engine


def _export_snapshot(
    snapshot_id: str, stack: ExitStack, *, store: Store | None, object_path: Path | None
) -> Path:
    assert store is not None and object_path is not None  # resolve_target checked them
    out = (
        Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-eval-")))
        / f"snapshot-{snapshot_id[:12]}"
    )
    export_snapshot(store, open_object_store("fs", path=object_path), store.get_snapshot(snapshot_id), out)
    return out


# --------------------------------------------------------------------------- records


def create_eval_record(
    store: Store,
    cfg: EvalConfig,
    target: Target,
    data: EvalData,
    *,
    run_id: str | None = None,
    step: int | None = None,
) -> EvalRecord:
    return store.create_eval(
        model=target.description,
        model_identity=target.identity,
        engine=target.engine,
        env=env_label(cfg.env),
        data_path=str(data.path.resolve()),
        data_digest=data.digest,
        n_prompts=len(data.rows),
        n=cfg.n,
        seed=cfg.seed,
        success_threshold=cfg.success_threshold,
        sampling=sampling_dict(cfg),
        # absolute paths: `--resume` may run from another folder
        config_json=cfg.model_copy(update={"data": data.path.resolve()}).recorded_json(),
        name=cfg.name,
        run_id=run_id,
        step=step,
    )


def sampling_dict(cfg: EvalConfig) -> dict[str, Any]:
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
        "stop": list(cfg.stop),
        "max_turns": cfg.max_turns,
    }


def check_resume(record: EvalRecord, data: EvalData, target: Target) -> None:
    """Refuse to resume onto other data or another model than the eval started with."""
    if record.data_digest is not None and data.digest != record.data_digest:
        raise DataError(
            f"{data.path}: the data changed since eval {record.id} started"
            f" (blake3 {data.digest[:12]}… != recorded {record.data_digest[:12]}…)",
            details=["resume with the original file (--data PATH if it moved), or start a new eval"],
        )
    if record.model_identity is not None and target.identity != record.model_identity:
        raise ModelError(
            f"the model changed since eval {record.id} started ({target.identity} != {record.model_identity})"
        )


# --------------------------------------------------------------------------- running


def execute_eval(
    store: Store,
    record: EvalRecord,
    cfg: EvalConfig,
    engine: InferenceEngine | None,
    data: EvalData,
    *,
    previous: Sequence[EvalSampleRecord] = (),
    output: Path | None = None,
    on_progress: ProgressFn | None = None,
) -> EvalSummary:
    """Run the missing samples, store them as they finish, then summarise the stored rows.

    `engine` may be None when nothing is missing (a resume of a finished eval). The eval's
    status ends `succeeded`, or `failed` / `cancelled` (with the error) when this raises.
    """
    t0 = time.monotonic()
    out = _OutputFile(output, record.id) if output is not None else None
    if out is not None:
        out.rewrite(previous)  # exactly what the store holds so far; new lines are appended
    missing = len(data.rows) * cfg.n - len(previous)
    retries = 0
    store.set_eval_status(record.id, "running")
    try:
        if missing > 0:
            assert engine is not None, "samples are missing: an engine is needed"
            retries = _run_missing(store, record.id, cfg, engine, data, previous, out, on_progress)
        samples = store.read_eval_samples(record.id)
        if len(samples) != len(data.rows) * cfg.n:
            raise StorageError(
                f"eval {record.id}: {len(samples)} samples stored, expected {len(data.rows) * cfg.n}"
            )
        summary = summarize_samples(samples, ks=cfg.k, seed=cfg.seed)
        if out is not None:
            out.rewrite(samples)
    except KeyboardInterrupt:
        store.set_eval_status(record.id, "cancelled", error="interrupted")
        raise
    except RolloutError as err:
        store.set_eval_status(record.id, "failed", error=str(err))
        raise
    except BaseException as err:
        store.set_eval_status(record.id, "failed", error=f"{type(err).__name__}: {err}")
        raise
    before = record.timings or {}
    wall = time.monotonic() - t0
    timings = {
        "wall_s": float(before.get("wall_s", 0.0)) + wall,
        "sessions": int(before.get("sessions", 0)) + 1,
        "last_session_s": wall,
        "last_session_samples": missing,
        "retries": int(before.get("retries", 0)) + retries,
        "completion_tokens": sum(s.completion_tokens for s in samples),
    }
    store.set_eval_status(record.id, "succeeded", summary=summary_to_dict(summary), timings=timings)
    return summary


def _run_missing(
    store: Store,
    eval_id: str,
    cfg: EvalConfig,
    engine: InferenceEngine,
    data: EvalData,
    previous: Sequence[EvalSampleRecord],
    out: _OutputFile | None,
    on_progress: ProgressFn | None,
) -> int:
    """Generate what `previous` lacks; returns how many attempts were retried."""
    endpoint = cfg.engine == "openai"
    sampler = EngineSampler(
        engine,
        max_batch=1 if endpoint else 4 * cfg.max_batch_size,
        max_in_flight=cfg.max_concurrency if endpoint else 1,
        retry=RetryPolicy(cfg.max_attempts, cfg.retry_backoff_s, cfg.retry_max_backoff_s),
    )

    def write(batch: list[EvalSampleRecord]) -> None:
        store.add_eval_samples(eval_id, batch)  # the store first: the output never holds more
        if out is not None:
            out.append(batch)
        if on_progress is not None:
            on_progress(len(batch), sum(s.completion_tokens for s in batch))

    params = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, stop=tuple(cfg.stop)
    )
    try:
        with _Heartbeat(store, eval_id):
            asyncio.run(
                run_eval(
                    sampler, resolve_env(cfg.env), data.rows, n=cfg.n, seed=cfg.seed, params=params,
                    max_turns=cfg.max_turns, success_threshold=cfg.success_threshold, ks=cfg.k,
                    previous=previous, on_samples=write,
                    max_active=2 * sampler.max_batch * sampler.max_in_flight,
                )
            )  # fmt: skip
    finally:
        sampler.close()
    return sampler.retries


class _OutputFile:
    """`--output`: appended as samples are stored; rewritten (atomically) from the store's rows at
    the start (so a line torn by a kill mid-append is gone on resume) and at the end."""

    def __init__(self, path: Path, eval_id: str) -> None:
        self.path = Path(path)
        self.eval_id = eval_id
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def rewrite(self, samples: Sequence[EvalSampleRecord]) -> None:
        ordered = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8", newline="\n") as f:
            f.writelines(self._line(s) for s in ordered)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, samples: Sequence[EvalSampleRecord]) -> None:
        with self.path.open("a", encoding="utf-8", newline="\n") as f:
            f.writelines(self._line(s) for s in samples)

    def _line(self, sample: EvalSampleRecord) -> str:
        return json.dumps({"eval_id": self.eval_id, **sample.to_dict()}, ensure_ascii=False) + "\n"


class _Heartbeat:
    """Stamps the eval's `heartbeat_at` every `$ROLLOUT_HEARTBEAT_S` seconds (default 5) while it runs.

    A failed beat doesn't stop the eval (the store may be back before any reader's timeout);
    the next sample write reports a store that stays down.
    """

    def __init__(self, store: Store, eval_id: str) -> None:
        self._store, self._eval_id = store, eval_id
        self._interval = heartbeat_interval_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{eval_id}", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.eval_heartbeat(self._eval_id)
            except StorageError:
                continue
