"""Pieces every training algorithm composes: run lifecycle, model loading,
train_state snapshots and progress. Each algorithm module keeps its own loop;
this file holds only what would otherwise be copied verbatim.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.backends.base import BackendState
from rollout.config import BaseModelConfig, BudgetConfig, LoraConfig, RunConfig
from rollout.errors import AlgorithmError, ModelError, RolloutError
from rollout.store import open_object_store, open_store
from rollout.store.base import RunRecord, SnapshotRecord, Store
from rollout.store.objects import ObjectStore

# --------------------------------------------------------------------------- run lifecycle


@dataclass
class RunContext:
    config: RunConfig
    store: Store
    objects: ObjectStore
    run: RunRecord
    run_dir: Path
    recorder: Any  # rollout.observe.RunRecorder
    resume_from: SnapshotRecord | None = None
    resume_state: tuple[BackendState, dict[str, Any]] | None = None
    snapshots: list[SnapshotRecord] = field(default_factory=list)


def open_stores(cfg: RunConfig) -> tuple[Store, ObjectStore]:
    st = cfg.storage
    store = open_store(
        st.backend,
        path=st.embedded.path if st.backend == "embedded" else None,
        dsn=st.postgres.dsn if st.postgres is not None else None,
    )
    return store, open_object_store(st.objects.backend, path=st.objects.path)


@contextmanager
def run_lifecycle(cfg: RunConfig, *, resume: str | None) -> Iterator[RunContext]:
    """Create the run row, the recorder and the run folder; set the final status.

    The snapshot to resume from is resolved *before* the run row exists, so an
    unknown id fails cleanly (`snapshot not found: <id>`) without a stray run.
    """
    from rollout.observe import Heartbeat, RunRecorder, heartbeat_interval_s

    beat_s = heartbeat_interval_s()  # a bad $ROLLOUT_HEARTBEAT_S fails here, before any run row exists
    store, objects = open_stores(cfg)
    resume_from, resume_state = None, None
    if resume is not None:
        resume_from = store.get_snapshot(resume)
        if resume_from.kind != "train_state":
            raise AlgorithmError(f"snapshot {resume_from.id[:12]} is a {resume_from.kind} snapshot, not train_state")
        algo = resume_from.manifest.get("extra", {}).get("algorithm")
        if algo != cfg.algorithm.kind:
            raise AlgorithmError(
                f"snapshot {resume_from.id[:12]} was saved by {algo}, cannot resume {cfg.algorithm.kind} from it"
            )
        # Read (and digest-verify) the state now: a corrupted snapshot fails before any run row exists.
        resume_state = read_train_state(objects, resume_from)
    run = store.create_run(
        algorithm=cfg.algorithm.kind,
        config_digest=cfg.digest(),
        config_json=cfg.canonical_json(),
        name=cfg.name,
        resumed_from=resume_from.id if resume_from else None,
    )
    run_dir = cfg.storage.resolved_runs_dir() / run.id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.canonical_json() + "\n")
    recorder = RunRecorder(store, run.id, run_dir / "events.jsonl")
    heartbeat = Heartbeat(store, run.id, interval_s=beat_s)  # readers mark the run crashed if its process dies silently
    ctx = RunContext(cfg, store, objects, run, run_dir, recorder, resume_from, resume_state)
    store.set_run_status(run.id, "running")
    heartbeat.start()
    try:
        yield ctx
    except KeyboardInterrupt:
        _end(ctx, heartbeat, "cancelled", "interrupted")
        raise
    except RolloutError as err:
        _end(ctx, heartbeat, "failed", str(err))
        raise
    except BaseException as err:
        _end(ctx, heartbeat, "failed", f"{type(err).__name__}: {err}")
        raise
    else:
        _end(ctx, heartbeat, "succeeded", None)


def _end(ctx: RunContext, heartbeat: Any, status: str, error: str | None) -> None:
    try:
        ctx.recorder.close()
    finally:
        heartbeat.stop()  # after the recorder's last flush, before the final status
        ctx.store.set_run_status(ctx.run.id, status, error=error)  # type: ignore[arg-type]
        ctx.store.close()


# --------------------------------------------------------------------------- budget


def resolve_total_steps(
    budget: BudgetConfig, *, batches_per_epoch: int, grad_accum: int, tokens_per_batch: float
) -> int:
    """Optimizer steps the lr schedule spans (exact for max_steps / max_epochs, estimated for max_tokens)."""
    if budget.max_steps is not None:
        return budget.max_steps
    if budget.max_epochs is not None:
        return max(1, math.floor(budget.max_epochs * batches_per_epoch / grad_accum))
    assert budget.max_tokens is not None
    return max(1, math.ceil(budget.max_tokens / max(1.0, tokens_per_batch * grad_accum)))


def tokenize_aligned(tokenize: Any, rows: list[Any]) -> tuple[list[Any], Any, list[Any]]:
    """`tokenize(rows) -> (items, stats)`, plus the rows that survived, aligned with items.

    Tokenizers drop rows left without loss tokens after truncation; per-row
    fields (labels, margins) must follow the survivors. The common case (no
    drops) costs one batched call; otherwise rows are re-tokenized one by one.
    """
    items, stats = tokenize(rows)
    if len(items) == len(rows):
        return items, stats, rows
    kept = [row for row in rows if tokenize([row])[0]]
    if len(kept) != len(items):
        raise AlgorithmError(f"internal: {len(kept)} rows kept but {len(items)} items tokenized")
    return items, stats, kept


# --------------------------------------------------------------------------- models


def load_tokenizer(spec: BaseModelConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            spec.uri, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    except Exception as err:  # transformers raises OSError/ValueError/HF errors
        raise ModelError(f"cannot load tokenizer from {spec.uri}: {_first_line(err)}") from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"tokenizer at {spec.uri} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: BaseModelConfig, *, task: str, pad_token_id: int, seed: int) -> Any:
    """`task`: "causal_lm" or "reward" (a 1-logit sequence-classification head)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)  # new heads (the RM score layer) are initialised from the run's seed
    kwargs = dict(
        revision=spec.revision,
        trust_remote_code=spec.trust_remote_code,
        dtype=getattr(torch, spec.dtype),
        attn_implementation="sdpa",
    )
    try:
        if task == "causal_lm":
            model = AutoModelForCausalLM.from_pretrained(spec.uri, **kwargs)
        else:
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # "score.weight newly initialized" is expected here
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    spec.uri, num_labels=1, pad_token_id=pad_token_id, **kwargs
                )
            finally:
                hf_logging.set_verbosity(verbosity)
    except Exception as err:
        raise ModelError(f"cannot load model from {spec.uri}: {_first_line(err)}") from None
    model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    return model


def prepare_process(cfg: RunConfig) -> None:
    """Thread count and every RNG seeded from the run's seed, before anything random happens."""
    from rollout.rng import seed_everything

    if cfg.backend.num_threads:
        import torch

        torch.set_num_threads(cfg.backend.num_threads)
    seed_everything(cfg.seed)


def load_trainable(settings: Any, *, task: str, pad_token_id: int, seed: int, device: Any) -> Any:
    """The model an algorithm trains: base weights, LoRA adapters if configured, on `device`."""
    model = load_model(settings.base_model, task=task, pad_token_id=pad_token_id, seed=seed)
    if settings.lora is not None:
        model = apply_lora(model, settings.lora, task=task)
    return model.to(device)


def snapshot_extra(cfg: RunConfig, settings: Any, *, model_class: str, **more: Any) -> dict[str, Any]:
    """What a train_state manifest records about the run besides its blobs."""
    return {
        "algorithm": cfg.algorithm.kind, "model_class": model_class,
        "lora": settings.lora.model_dump(mode="json") if settings.lora else None,
        "base_model": settings.base_model.uri, "config_digest": cfg.digest(), **more,
    }


def apply_lora(model: Any, lora: LoraConfig, *, task: str) -> Any:
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type=TaskType.CAUSAL_LM if task == "causal_lm" else TaskType.SEQ_CLS,
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise ModelError(f"LoRA: {_first_line(err)}") from None


def hf_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (LoRA layers stay active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


# --------------------------------------------------------------------------- train_state snapshots


def model_file_blobs(model: Any, tokenizer: Any) -> dict[str, bytes]:
    """config.json of the model being trained (LoRA merged away) and the tokenizer files."""
    blobs = {"model_config": hf_model(model).config.to_json_string(use_diff=False).encode()}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                blobs[f"tokenizer/{path.name}"] = path.read_bytes()
    return blobs


def save_train_state(
    ctx: RunContext,
    state: BackendState,
    *,
    step: int,
    loop_state: Mapping[str, Any],
    static_blobs: Mapping[str, bytes],
    extra: Mapping[str, Any],
) -> SnapshotRecord:
    """Commit a train_state snapshot and prune old ones (keep_last)."""
    from rollout.snapshots import Blob, commit_snapshot, prune_snapshots

    blobs: dict[str, Blob] = {}
    for name, data in state.blobs.items():
        meta = {"tensors": dict(state.tensors[name])} if name in state.tensors else {}
        blobs[name] = Blob(data=bytes(data), meta=meta)
    for name, data in static_blobs.items():
        blobs[name] = Blob(data=data)
    payload = {"backend": dict(state.meta), "loop": dict(loop_state)}
    blobs["state"] = Blob(data=json.dumps(payload, sort_keys=True).encode())
    parent = ctx.snapshots[-1].id if ctx.snapshots else (ctx.resume_from.id if ctx.resume_from else None)
    ctx.recorder.flush()  # events up to this step are durable before the snapshot row is
    record = commit_snapshot(
        ctx.store, ctx.objects, run_id=ctx.run.id, kind="train_state", step=step,
        blobs=blobs, extra=dict(extra), parent_id=parent,
    )
    ctx.snapshots.append(record)
    ctx.recorder.event("snapshot_saved", snapshot_id=record.id, step=step)
    keep_last = ctx.config.algorithm.settings.snapshot.keep_last
    if keep_last is not None:
        prune_snapshots(ctx.store, run_id=ctx.run.id, keep_last=keep_last, keep_labeled=True)
    return record


def read_train_state(objects: ObjectStore, record: SnapshotRecord) -> tuple[BackendState, dict[str, Any]]:
    """The backend state and loop state of a train_state snapshot (every blob digest-verified)."""
    from rollout.snapshots import read_snapshot_blob

    payload = json.loads(read_snapshot_blob(objects, record, "state"))
    names = [n for n in record.manifest["blobs"] if n in ("model", "optimizer")]
    blobs = {n: read_snapshot_blob(objects, record, n) for n in names}
    return BackendState(blobs=blobs, meta=payload["backend"]), payload["loop"]


@dataclass(frozen=True)
class TrainResult:
    run_id: str
    steps: int
    final_snapshot_id: str
    metrics: dict[str, float]


async def snapshot_backend(
    ctx: RunContext,
    backend: Any,
    *,
    step: int,
    loop_state: Mapping[str, Any],
    static_blobs: Mapping[str, bytes],
    extra: Mapping[str, Any],
) -> str:
    """Snapshot the backend at `step` unless that step was just saved; returns the id."""
    if ctx.snapshots and ctx.snapshots[-1].step == step:
        return ctx.snapshots[-1].id
    state = await backend.state()
    record = save_train_state(ctx, state, step=step, loop_state=loop_state, static_blobs=static_blobs, extra=extra)
    return record.id


def build_torch_backend(
    model: Any, settings: Any, *, total_steps: int, device: Any, param_groups: list[dict[str, Any]] | None = None
) -> Any:
    """Optimizer, lr schedule and TorchBackend from an algorithm block (`settings`).

    `param_groups` (torch's form, a group's "lr" being its peak lr) replaces `model.parameters()`.
    """
    from rollout.backends.torch_backend import TorchBackend, lr_multiplier, make_lr_schedule, make_optimizer

    opt, sched = settings.optimizer, settings.scheduler
    if opt.kind == "adamw":
        hyper = {"betas": opt.betas, "eps": opt.eps}
    else:
        hyper = {"momentum": opt.momentum, "nesterov": opt.nesterov}
    params = param_groups if param_groups is not None else model.parameters()
    optimizer = make_optimizer(params, kind=opt.kind, lr=opt.lr, weight_decay=opt.weight_decay, **hyper)
    scheduler = make_lr_schedule(
        optimizer,
        lambda i: lr_multiplier(
            i, kind=sched.kind, warmup_steps=sched.warmup_steps, total_steps=total_steps,
            min_lr_ratio=sched.min_lr_ratio,
        ),
    )
    return TorchBackend(model, optimizer, scheduler, device=device, max_grad_norm=settings.max_grad_norm)


@dataclass
class LoopState:
    """What the loop itself carries across a resume (the backend carries the rest)."""

    step: int
    cursor: Any  # rollout.data.loader.DataCursor
    tokens_seen: int
    restored: dict[str, Any] = field(default_factory=dict)  # the whole saved loop state (RL keeps more in it)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor.to_dict(), "tokens_seen": self.tokens_seen}


async def restore_or_start(ctx: RunContext, backend: Any) -> LoopState:
    """Load the resume snapshot into the backend (if any) and return where the loop continues."""
    from rollout.data.loader import DataCursor

    if ctx.resume_from is None:
        return LoopState(step=0, cursor=DataCursor(epoch=0, batch=0), tokens_seen=0)
    assert ctx.resume_state is not None  # read by run_lifecycle
    state, loop = ctx.resume_state
    ctx.resume_state = None  # free the bytes once loaded
    await backend.load_state(state)
    return LoopState(
        step=loop["step"], cursor=DataCursor.from_dict(loop["cursor"]), tokens_seen=loop["tokens_seen"], restored=loop
    )


def snapshot_due(settings: Any, step: int, total_steps: int) -> bool:
    every = settings.snapshot.every_steps
    return bool(every) and step % every == 0 and step < total_steps


async def finish_training(
    ctx: RunContext, backend: Any, model: Any, tokenizer: Any, settings: Any, loop: LoopState, *,
    static_blobs: Mapping[str, bytes], extra: Mapping[str, Any], metrics: Mapping[str, float],
) -> TrainResult:
    """Final snapshot, optional HF export, `train_end`."""
    final = await snapshot_backend(
        ctx, backend, step=loop.step, loop_state=loop.to_dict(), static_blobs=static_blobs, extra=extra
    )
    if settings.export is not None:
        from rollout.export import export_model_dir

        export_model_dir(model, tokenizer, settings.export.dir)
        ctx.recorder.event("model_exported", dir=str(settings.export.dir), snapshot_id=final)
    ctx.recorder.event(
        "train_end", steps=loop.step, final_snapshot_id=final, **{k.replace("/", "_"): v for k, v in metrics.items()}
    )
    return TrainResult(run_id=ctx.run.id, steps=loop.step, final_snapshot_id=final, metrics=dict(metrics))


# --------------------------------------------------------------------------- progress


class TrainProgress:
    """A rich progress bar on a TTY; plain `key=value` lines on stderr otherwise."""

    def __init__(self, description: str, total: int, *, start: int = 0) -> None:
        self.total, self.start = total, start
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 20)
        self._bar: Any = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> TrainProgress:
        if self.tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description_text, total=self.total, completed=self.start, info="")
        return self

    @property
    def description_text(self) -> str:
        return "train"

    def update(self, step: int, info: Mapping[str, float]) -> None:
        text = " ".join(f"{k}={_fmt(v)}" for k, v in info.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=text)
        elif step % self.every == 0 or step == self.total:
            print(f"step={step}/{self.total} {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
