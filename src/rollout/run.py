"""A training run's lifecycle: its row, folder, recorder and final status, and the
save/restore points a training loop calls.

    with run_lifecycle(cfg, resume=None) as ctx:         # run row "running", recorder open
        prepare_process(cfg)                             # threads, CPU products' library, RNGs
        loop = await restore_or_start(ctx, backend)      # LoopState of a fresh run or the resume snapshot
        ...                                              # the algorithm's own loop
        await evaluate_if_due(ctx, loop.step, model, tokenizer)   # [eval], when the step is on its cadence
        await snapshot_backend(ctx, backend, step=loop.step, loop_state=loop.to_dict(), ...)
        return await finish_training(ctx, backend, model, tokenizer, loop, ...)
                                                         # status: succeeded, failed or cancelled

Each algorithm module keeps its own loop; this module holds only what every
loop would otherwise copy. `run_lifecycle` takes the run config (it records
it); everything else takes plain values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rollout import setup_gc
from rollout.algorithms.config import TrainCommon
from rollout.algorithms.registry import TrainResult
from rollout.backends.base import BackendState, TrainingBackend
from rollout.checkpoint import LoopState, commit_train_state, read_train_state
from rollout.config import RunConfig
from rollout.data.loader import DataCursor
from rollout.distributed import (
    LOCAL,
    Distributed,
    NullRecorder,
    announce_run,
    gathered_model,
    join_process_group,
)
from rollout.errors import AlgorithmError, ConfigError, DistributedError, RolloutError
from rollout.eval.during_training import PeriodicEval, load_periodic_eval
from rollout.export import export_model_dir
from rollout.observe import Heartbeat, RunRecorder, heartbeat_interval_s
from rollout.observe_trackers import open_tracker_sinks
from rollout.rng import seed_everything
from rollout.snapshots import prune_snapshots
from rollout.store import open_object_store, open_store
from rollout.store.base import RunRecord, RunStatus, SnapshotRecord, Store
from rollout.store.objects import ObjectStore
from rollout.store.write_behind import finish_uploads

SettingsT = TypeVar("SettingsT", bound=TrainCommon)

# --------------------------------------------------------------------------- run lifecycle


@dataclass
class RunContext:
    config: RunConfig
    store: Store
    objects: ObjectStore
    run: RunRecord
    run_dir: Path
    recorder: RunRecorder | NullRecorder
    resume_from: SnapshotRecord | None = None
    resume_state: tuple[BackendState, dict[str, Any]] | None = None
    snapshots: list[SnapshotRecord] = field(default_factory=list)
    keep_last: int | None = None
    """train_state snapshots of this run to keep (older unlabeled ones are pruned); None keeps all."""
    evals: PeriodicEval | None = None
    """The config's `[eval]`, run during training (`evaluate_if_due`); None without one."""
    dist: Distributed = LOCAL
    """This process's rank under torchrun (`rollout.distributed`); only rank 0 writes the run."""


def settings_for(cfg: RunConfig, settings: type[SettingsT]) -> SettingsT:
    """`cfg`'s `[algorithm.<kind>]` block, checked to be a `settings` (the CLI matches the kind to
    the sub-command; a direct caller of `train_<kind>` may not)."""
    block = cfg.algorithm.settings
    if not isinstance(block, settings):
        raise ConfigError(f"algorithm.kind is {cfg.algorithm.kind!r}: its settings are not {settings.__name__}")
    return block


def open_stores(cfg: RunConfig) -> tuple[Store, ObjectStore]:
    st = cfg.storage
    store = open_store(
        st.backend,
        path=st.embedded.path if st.backend == "embedded" else None,
        dsn=st.postgres.dsn if st.postgres is not None else None,
    )
    o = st.objects  # s3/gcs: puts are staged under o.path and uploaded in the background (write_behind)
    objects = open_object_store(
        o.backend, path=o.path, url=o.url, endpoint_url=o.endpoint_url, region=o.region,
        max_attempts=o.max_attempts, write_behind=True,
    )
    return store, objects


@contextmanager
def run_lifecycle(cfg: RunConfig, *, resume: str | None) -> Iterator[RunContext]:
    """Create the run row, the recorder and the run folder; set the final status. Automatic garbage
    collection pauses until the loop starts (`restore_or_start`; `rollout.setup_gc`), called through
    the CLI or from Python (a recipe function: `train_grpo(cfg)`) alike.

    The snapshot to resume from is resolved *before* the run row exists, so an
    unknown id fails cleanly (`snapshot not found: <id>`) without a stray run.

    Under torchrun (`rollout.distributed`) rank 0 does all of this; the other ranks wait for the
    run's id, then read its row and the resume snapshot, and record nothing.
    """
    with setup_gc.paused_for_setup(), _lifecycle(cfg, resume=resume) as ctx:  # (no-op inside the CLI's pause)
        yield ctx


@contextmanager
def _lifecycle(cfg: RunConfig, *, resume: str | None) -> Iterator[RunContext]:
    beat_s = heartbeat_interval_s()  # a bad $ROLLOUT_HEARTBEAT_S fails here, before any run row exists
    dist = join_process_group(cfg.distributed, device=cfg.backend.device)
    if not dist.is_rank0:
        with _follower_lifecycle(cfg, dist, resume=resume) as ctx:
            yield ctx
        return
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
    evals = load_periodic_eval(cfg.eval) if cfg.eval is not None else None  # a bad [eval] row: no stray run
    run = store.create_run(
        algorithm=cfg.algorithm.kind,
        config_digest=cfg.digest(),
        config_json=cfg.canonical_json(),
        name=cfg.name,
        resumed_from=resume_from.id if resume_from else None,
    )
    # Running, with a heartbeat, at once: a process killed from here on leaves a run that readers
    # mark crashed (a `pending` run is marked too, from its creation time, for the instant between).
    heartbeat = Heartbeat(store, run.id, interval_s=beat_s)  # readers mark the run crashed if its process dies silently
    store.set_run_status(run.id, "running")
    heartbeat.start()
    run_dir = cfg.storage.resolved_runs_dir() / run.id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.canonical_json() + "\n")
    announce_run(run.id)
    trackers = open_tracker_sinks(  # [observe]: TensorBoard, W&B, MLflow mirror the metrics and config
        cfg.observe, run_id=run.id, run_name=cfg.name, algorithm=cfg.algorithm.kind, run_dir=run_dir,
        runs_dir=cfg.storage.resolved_runs_dir(), config=cfg.model_dump(mode="json"),
    )
    recorder = RunRecorder(store, run.id, run_dir / "events.jsonl", sinks=trackers)
    ctx = RunContext(cfg, store, objects, run, run_dir, recorder, resume_from, resume_state,
                     keep_last=cfg.algorithm.settings.snapshot.keep_last, evals=evals, dist=dist)
    if dist.active:
        recorder.event("process_group", world_size=dist.world_size, sharding=dist.sharding)
    try:
        dist.broadcast_text(run.id)
        with _peer_failures(dist):
            yield ctx
        finish_uploads(ctx.objects)  # s3/gcs: the last snapshot rows land before the run counts as succeeded
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


def _end(ctx: RunContext, heartbeat: Heartbeat, status: RunStatus, error: str | None) -> None:
    try:
        ctx.recorder.close()
    finally:
        heartbeat.stop()  # after the recorder's last flush, before the final status
        try:
            finish_uploads(ctx.objects)  # a failed run's snapshots already uploading still land (no-op if done)
        finally:
            ctx.store.set_run_status(ctx.run.id, status, error=error)
            ctx.store.close()
            ctx.dist.close()


@contextmanager
def _follower_lifecycle(cfg: RunConfig, dist: Distributed, *, resume: str | None) -> Iterator[RunContext]:
    """A rank other than 0: the run rank 0 created (read only), the resume state, no recorder."""
    try:
        with _peer_failures(dist):
            run_id = dist.broadcast_text("")  # once rank 0 has checked the resume id and created the run
            store, objects = open_stores(cfg)
            try:
                resume_from = store.get_snapshot(resume) if resume is not None else None
                resume_state = read_train_state(objects, resume_from) if resume_from is not None else None
                evals = load_periodic_eval(cfg.eval) if cfg.eval is not None else None
                yield RunContext(cfg, store, objects, store.get_run(run_id), cfg.storage.resolved_runs_dir() / run_id,
                                 NullRecorder(), resume_from, resume_state, evals=evals, dist=dist)
            finally:
                store.close()
    finally:
        dist.close()


@contextmanager
def _peer_failures(dist: Distributed) -> Iterator[None]:
    """A collective that fails because a peer rank died becomes one clear `DistributedError`."""
    if not dist.active:
        yield
        return
    import torch.distributed as tdist

    try:
        yield
    except RuntimeError as err:
        text = str(err).strip()
        # gloo reports a dead peer as a plain RuntimeError ("[.../gloo/...] Connection reset by peer")
        if not isinstance(err, tdist.DistError) and not any(w in text.lower() for w in ("gloo", "nccl")):
            raise
        first = (text.splitlines() or [type(err).__name__])[0]
        raise DistributedError(f"rank {dist.rank}: a collective with the other ranks failed"
                               f" (did a rank die?): {first}") from err


def prepare_process(cfg: RunConfig) -> None:
    """`[backend]`'s thread count and CPU products' library (`cpu_matmul`), and every RNG seeded from
    the run's seed, before anything random happens."""
    if cfg.backend.num_threads:
        import torch

        torch.set_num_threads(cfg.backend.num_threads)
    from rollout.models.cpu_matmul import set_cpu_matmul

    set_cpu_matmul(cfg.backend.cpu_matmul)
    seed_everything(cfg.seed)


# --------------------------------------------------------------------------- budget


def resolve_total_steps(
    *, max_steps: int | None, max_epochs: float | None, max_tokens: int | None,
    batches_per_epoch: int, grad_accum: int, tokens_per_batch: float,
) -> int:
    """Optimizer steps the lr schedule spans (exact for max_steps / max_epochs, estimated for max_tokens)."""
    if max_steps is not None:
        return max_steps
    if max_epochs is not None:
        return max(1, math.floor(max_epochs * batches_per_epoch / grad_accum))
    assert max_tokens is not None
    return max(1, math.ceil(max_tokens / max(1.0, tokens_per_batch * grad_accum)))


# --------------------------------------------------------------------------- snapshots of the run


def snapshot_extra(cfg: RunConfig, *, model_class: str, **more: Any) -> dict[str, Any]:
    """What a train_state manifest records about the run besides its blobs."""
    s = cfg.algorithm.settings
    return {
        "algorithm": cfg.algorithm.kind, "model_class": model_class,
        "lora": s.lora.model_dump(mode="json") if s.lora else None,
        "base_model": s.base_model.uri, "config_digest": cfg.digest(), **more,
    }


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
    parent = ctx.snapshots[-1].id if ctx.snapshots else (ctx.resume_from.id if ctx.resume_from else None)
    ctx.recorder.flush()  # events up to this step are durable before the snapshot row is
    record = commit_train_state(
        ctx.store, ctx.objects, state, run_id=ctx.run.id, step=step, loop_state=loop_state,
        static_blobs=static_blobs, extra=extra, parent_id=parent,
    )
    ctx.snapshots.append(record)
    ctx.recorder.event("snapshot_saved", snapshot_id=record.id, step=step)
    if ctx.keep_last is not None:
        prune_snapshots(ctx.store, run_id=ctx.run.id, keep_last=ctx.keep_last, keep_labeled=True)
    return record


async def snapshot_backend(
    ctx: RunContext,
    backend: TrainingBackend[Any],
    *,
    step: int,
    loop_state: Mapping[str, Any],
    static_blobs: Mapping[str, bytes],
    extra: Mapping[str, Any],
) -> str:
    """Snapshot the backend at `step` unless that step was just saved; returns the id."""
    if ctx.snapshots and ctx.snapshots[-1].step == step:
        return ctx.snapshots[-1].id
    state = await backend.state()  # under torchrun: every rank (FSDP2 gathers the full state onto rank 0)
    if ctx.dist.is_rank0:
        record = save_train_state(ctx, state, step=step, loop_state=loop_state, static_blobs=static_blobs,
                                  extra=extra)
    snapshot_id = ctx.dist.broadcast_text(record.id if ctx.dist.is_rank0 else "")
    if not ctx.dist.is_rank0:
        ctx.snapshots.append(ctx.store.get_snapshot(snapshot_id))
    return snapshot_id


async def restore_or_start(ctx: RunContext, backend: TrainingBackend[Any]) -> LoopState:
    """Load the resume snapshot into the backend (if any) and return where the loop continues.
    Set-up ends here: a paused garbage collector comes back on (`rollout.setup_gc`)."""
    if ctx.resume_from is None:
        setup_gc.setup_done()
        return LoopState(step=0, cursor=DataCursor(epoch=0, batch=0), tokens_seen=0)
    assert ctx.resume_state is not None  # read by run_lifecycle
    state, loop = ctx.resume_state
    ctx.resume_state = None  # free the bytes once loaded
    await backend.load_state(state)
    setup_gc.setup_done()
    return LoopState(
        step=loop["step"], cursor=DataCursor.from_dict(loop["cursor"]), tokens_seen=loop["tokens_seen"], restored=loop
    )


# --------------------------------------------------------------------------- eval during training


async def evaluate_if_due(ctx: RunContext, step: int, model: Any, tokenizer: Any, *, final: bool = False) -> None:
    """The config's `[eval]` on `model` as it is after optimizer step `step`, when that step is on
    its cadence (or `final`); `eval/<metric>` metrics at `step` and an eval record of the run."""
    if ctx.evals is None or not ctx.evals.due(step, final=final):
        return
    with gathered_model(model, ctx.dist) as full:  # rank 0 evaluates; under FSDP2 on a gathered copy
        if full is None:
            ctx.evals.last_step = step
        else:
            await ctx.evals.maybe_run(
                step, full, tokenizer, store=ctx.store, run_id=ctx.run.id, recorder=ctx.recorder, final=final
            )


async def finish_training(
    ctx: RunContext, backend: TrainingBackend[Any], model: Any, tokenizer: Any, loop: LoopState, *,
    export_dir: Path | None, static_blobs: Mapping[str, bytes], extra: Mapping[str, Any],
    metrics: Mapping[str, float],
) -> TrainResult:
    """Final snapshot, the final `[eval]`, optional HF export (of `model`, to `export_dir`), `train_end`."""
    final = await snapshot_backend(
        ctx, backend, step=loop.step, loop_state=loop.to_dict(), static_blobs=static_blobs, extra=extra
    )
    await evaluate_if_due(ctx, loop.step, model, tokenizer, final=True)
    if export_dir is not None:
        with gathered_model(model, ctx.dist) as full:  # rank 0 writes it
            if full is not None:
                export_model_dir(full, tokenizer, export_dir)
                ctx.recorder.event("model_exported", dir=str(export_dir), snapshot_id=final)
    ctx.recorder.event(
        "train_end", steps=loop.step, final_snapshot_id=final, **{k.replace("/", "_"): v for k, v in metrics.items()}
    )
    return TrainResult(run_id=ctx.run.id, steps=loop.step, final_snapshot_id=final, metrics=dict(metrics))
