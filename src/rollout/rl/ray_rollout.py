"""Rollout workers on Ray: `[distributed] kind = "ray"` for GRPO and PPO.

    [distributed]
    kind = "ray"
    address = "local"            # starts Ray in this process; "auto" or "ray://host:port" joins a cluster
    num_rollout_workers = 2
    num_cpus_per_worker = 1

The learner is this process: it trains, keeps the `RolloutManager` (drawing prompts, group ids,
filtering, carried groups, the snapshot state) and a queue of the round's prompt groups. The
rollout workers are Ray actors (`RolloutWorker`), each with its own hf engine, reward functions
and env; they make groups with `generate_groups`, the function a local run calls.

Work stealing. The round's groups wait in the learner's queue; a worker holds one lease at a time
and gets the next one the moment it hands a lease back, so a fast worker takes more groups than a
slow one. A lease has an id, its groups and a deadline (`lease_timeout_s`); it holds half of
the worker's share of the queue, at most `max_groups_per_lease` groups (guided scheduling: big
leases while the queue is long, single groups at its end); the share is the worker's measured
speed (groups/s of its leases so far) over all live workers', equal until each has returned one. A worker that dies (its actor
fails, `ray.kill`) has its lease's groups re-queued for the others; a lease past its deadline is
re-queued as well, while the late worker carries on; a group's first result is taken and any
later one ignored (`rollout/duplicate_results`). A round fails only when no worker is left.

Weights. After each step the learner puts the weights into Ray's object store once
(`RayRollout.push`, the `WeightSync` seam) and every lease carries the policy version and a
reference to them; a worker whose engine holds another version fetches and loads them before it
samples, so a worker samples with exactly the version the learner asked for (the staleness of a
batch is the manager's `max_staleness` and `off_policy_steps`, as in a local run).

Determinism. Sampling is seeded per (seed, group id, choice) and a group's tokens do not depend
on the other requests of an engine call, so which worker makes a group, and with which others,
does not change the numbers: with the same thread count a Ray run ends with the same weights as
`kind = "local"` (tests/distributed/test_ray.py), also when a worker is killed mid-step.

Metrics. Each batch's metrics include `rollout/worker/<id>/groups`, `.../leases` and
`.../busy_s` per worker, `rollout/workers_alive`, `rollout/leases_requeued` and
`rollout/duplicate_results`; events `rollout_worker_died` and `lease_expired` name the worker.

`address = "local"` starts a Ray instance (`ray.init`) and stops it when the run ends; when this
process is already connected (a test's cluster, a script's `ray.init`), that connection is used
and left open. The workers are killed at the end either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollout.errors import AlgorithmError
from rollout.rl.manager import Group, GroupSpec, RoundItem

if TYPE_CHECKING:
    from rollout.algorithms.rl_common import SamplingEngine
    from rollout.config import RunConfig
    from rollout.rl.ray_learners import FollowerRollout

WORKER_ID_ENV = "ROLLOUT_WORKER_ID"
"""Set in each worker's process: its index (reward functions and envs may read it)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker builds its engine, rewards and env from (sent to each actor)."""

    model: Any  # rollout.models.load.ModelSource
    group: GroupSpec
    rewards: Sequence[Any]  # the [[rewards]] entries
    env: Any  # str | EpisodeEnvConfig | None
    device: str = "cpu"
    max_batch_size: int = 256
    num_threads: int | None = None
    kept_cache_bytes: int = 1 << 30  # kept_cache.DEFAULT_KEPT_CACHE_BYTES (that module imports torch)
    """The engine's cap on KV caches kept between an episode's turns (`[inference] kept_cache_mb`)."""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """Benchmarks only: worker id -> factor (a worker sleeps (factor - 1) x each lease's time)."""


@dataclass(frozen=True)
class LeaseResult:
    lease_id: int
    worker_id: int
    groups: list[Group]
    busy_s: float


class RolloutWorker:
    """One rollout worker (a Ray actor): an engine, the reward functions and env, and the policy
    version its engine holds."""

    def __init__(self, worker_id: int, spec: WorkerSpec) -> None:
        import torch

        from rollout.algorithms.rl_common import episode_setup, resolve_reward_specs
        from rollout.inference.hf_engine import BATCH_INVARIANT_PAD, load_hf_engine
        from rollout.inference.sampler import EngineSampler
        from rollout.models.load import load_tokenizer

        os.environ[WORKER_ID_ENV] = str(worker_id)
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.worker_id = worker_id
        self.spec = spec
        self.slowdown = float(spec.slowdown.get(worker_id, 1.0))
        self.engine = load_hf_engine(
            spec.model.uri, dtype=spec.model.dtype, device=spec.device, max_batch_size=spec.max_batch_size,
            trust_remote_code=spec.model.trust_remote_code, pad_multiple=BATCH_INVARIANT_PAD,
            kept_cache_bytes=spec.kept_cache_bytes,
        )
        self.sampler = EngineSampler(self.engine, max_batch=spec.max_batch_size)
        self.reward_fns = resolve_reward_specs(spec.rewards, spec.env, device=torch.device(spec.device),
                                               dtype=spec.model.dtype)
        self.episodes = episode_setup(spec.env, load_tokenizer(spec.model) if spec.env is not None else None)
        self.version: int | None = None
        self.loop = asyncio.new_event_loop()

    def ready(self) -> int:
        """The worker's process id, once its engine is loaded."""
        return os.getpid()

    def run_lease(self, lease_id: int, items: list[RoundItem], version: int, weights: list[Any]) -> LeaseResult:
        """Make the groups of one lease with policy `version` (`weights[0]`: its object ref, in a
        list so that Ray hands over the ref, fetched only when the engine holds another version)."""
        import ray

        started = time.perf_counter()
        if self.version != version:
            self.engine.update_weights(ray.get(weights[0]))
            self.version = version
        from rollout.rl.manager import generate_groups

        groups, _ = self.loop.run_until_complete(generate_groups(
            self.sampler, items, self.spec.group, reward_fns=self.reward_fns, episodes=self.episodes,
            policy_version=version,
        ))
        busy = time.perf_counter() - started
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * busy)
            busy = time.perf_counter() - started
        return LeaseResult(lease_id, self.worker_id, groups, busy)


@dataclass
class _Lease:
    lease_id: int
    worker: int
    positions: list[int]
    deadline: float
    expired: bool = False


@dataclass
class _WorkerStats:
    groups: int = 0
    leases: int = 0
    busy_s: float = 0.0


class RayRollout:
    """The learner's side: the worker actors, the group queue (`run_groups`, the manager's
    `GroupRunner`) and the weights in the object store (`push`, the `WeightSync`)."""

    keeps_serving = False
    sampler = None  # no engine in the learner's process

    def __init__(
        self, spec: WorkerSpec, *, num_workers: int, address: str = "local", num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0, max_groups_per_lease: int = 8, lease_timeout_s: float = 600.0,
        name: str = "rollout", on_event: Callable[[str, dict[str, Any]], None] | None = None,
        schedule: Literal["steal", "static"] = "steal",
    ) -> None:
        import ray

        self.max_groups_per_lease = max_groups_per_lease
        self.lease_timeout_s = lease_timeout_s
        self.on_event = on_event
        self.schedule = schedule
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if address == "local":
                cpus = max(os.cpu_count() or 1, math.ceil(num_workers * num_cpus_per_worker))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            else:
                ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        self.group_runner = self
        self.weight_sync = self
        self._weights: Any = None
        self._version: int | None = None
        self._next_lease = 0
        self._stats = [_WorkerStats() for _ in range(num_workers)]
        self._rates: list[float | None] = [None] * num_workers  # groups/s per worker (running average)
        self._requeued = 0
        self._duplicates = 0
        try:
            actor = ray.remote(RolloutWorker)
            self.workers: list[Any] = [
                actor.options(  # type: ignore[attr-defined]
                    name=f"{name}-worker-{i}", num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker,
                    max_restarts=0, max_task_retries=0,
                ).remote(i, spec)
                for i in range(num_workers)
            ]
            self.alive = [True] * num_workers
            self.pids = ray.get([w.ready.remote() for w in self.workers])
        except Exception:
            self.close()
            raise
        self._emit("rollout_workers_started", {"workers": num_workers, "pids": list(self.pids)})

    # ------------------------------------------------------------------ WeightSync

    def push(self, weights: Mapping[str, Any], *, version: int) -> None:
        """Put the weights of policy `version` into the object store (once; workers fetch them)."""
        import ray

        self._weights = ray.put({k: v.detach().to("cpu", copy=True) for k, v in weights.items()})
        self._version = version

    # ------------------------------------------------------------------ GroupRunner

    async def run_groups(self, items: Sequence[RoundItem], policy_version: int) -> list[Group]:
        """The round's groups, in the order of `items`, made by whichever workers are free."""
        import ray.exceptions

        if self._version != policy_version:
            raise AlgorithmError(
                f"rollout workers asked for policy version {policy_version} but the learner pushed {self._version}"
            )
        results: dict[int, Group] = {}
        queues = self._initial_queues(len(items))
        inflight: dict[asyncio.Future[Any], _Lease] = {}
        while len(results) < len(items):
            self._hand_out(queues, items, results, inflight)
            if not inflight:
                raise AlgorithmError("every rollout worker died; the round can't finish")
            live = [lease.deadline for lease in inflight.values() if not lease.expired]
            timeout = max(0.0, min(live) - time.monotonic()) if live else None
            done, _ = await asyncio.wait(inflight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                lease = inflight.pop(future)
                try:
                    result: LeaseResult = future.result()
                except ray.exceptions.RayActorError as err:
                    self._worker_died(lease, queues, results, err)
                    continue
                except ray.exceptions.RayTaskError as err:
                    raise AlgorithmError(f"rollout worker {lease.worker} failed: {err}") from None
                stats = self._stats[lease.worker]
                rate = len(lease.positions) / max(result.busy_s, 1e-6)
                previous = self._rates[lease.worker]
                self._rates[lease.worker] = rate if previous is None else (previous + rate) / 2
                stats.leases += 1
                stats.busy_s += result.busy_s
                for position, group in zip(lease.positions, result.groups, strict=True):
                    if position in results:
                        self._duplicates += 1  # a re-queued group came back twice: the first one counts
                    else:
                        results[position] = group
                        stats.groups += 1
            self._expire(inflight, queues, results)
        return [results[i] for i in range(len(items))]

    def _initial_queues(self, n: int) -> list[deque[int]]:
        """One shared queue (work stealing), or one per worker with a fixed share (static split,
        for comparison in benchmarks)."""
        if self.schedule == "steal":
            return [deque(range(n))]
        live = [w for w, ok in enumerate(self.alive) if ok]
        queues: list[deque[int]] = [deque() for _ in self.workers]
        for position in range(n):
            queues[live[position % len(live)]].append(position)
        return queues

    def _queue_of(self, queues: list[deque[int]], worker: int) -> deque[int]:
        return queues[0] if len(queues) == 1 else queues[worker]

    def _hand_out(
        self, queues: list[deque[int]], items: Sequence[RoundItem], results: dict[int, Group],
        inflight: dict[asyncio.Future[Any], _Lease],
    ) -> None:
        """A lease for every live worker without one, while groups wait."""
        busy = {lease.worker for lease in inflight.values()}
        for worker, handle in enumerate(self.workers):
            if not self.alive[worker] or worker in busy:
                continue
            queue = self._queue_of(queues, worker)
            while queue and queue[0] in results:
                queue.popleft()
            if not queue:
                continue
            size = max(1, min(self.max_groups_per_lease, math.ceil(len(queue) * self._share(worker, len(queues)) / 2)))
            positions = []
            while queue and len(positions) < size:
                position = queue.popleft()
                if position not in results:
                    positions.append(position)
            lease = _Lease(self._next_lease, worker, positions, time.monotonic() + self.lease_timeout_s)
            self._next_lease += 1
            ref = handle.run_lease.remote(lease.lease_id, [items[p] for p in positions], self._version, [self._weights])
            inflight[asyncio.wrap_future(ref.future())] = lease

    def _share(self, worker: int, num_queues: int) -> float:
        """The part of the queue `worker` should make: its measured speed over all live workers'
        (equal parts until every live worker has returned a lease)."""
        if num_queues > 1:
            return 1.0
        live = [w for w, ok in enumerate(self.alive) if ok]
        rates = [self._rates[w] for w in live]
        if any(r is None for r in rates):
            return 1 / len(live)
        rate = self._rates[worker]
        assert rate is not None
        return rate / sum(r for r in rates if r is not None)

    def _requeue(self, lease: _Lease, queues: list[deque[int]], results: dict[int, Group]) -> int:
        """Put a lease's unfinished groups back at the head of a queue a live worker reads."""
        missing = [p for p in lease.positions if p not in results]
        if len(queues) == 1:
            target = queues[0]
        else:  # static split: the least loaded live worker's queue
            live = [w for w, ok in enumerate(self.alive) if ok and w != lease.worker] or [lease.worker]
            target = queues[min(live, key=lambda w: len(queues[w]))]
        for position in reversed(missing):
            if position not in target:
                target.appendleft(position)
        self._requeued += len(missing)
        return len(missing)

    def _worker_died(self, lease: _Lease, queues: list[deque[int]], results: dict[int, Group], err: Exception) -> None:
        self.alive[lease.worker] = False
        if len(queues) > 1:  # static split: its share moves to the others
            share = list(queues[lease.worker])
            queues[lease.worker].clear()
            self._requeue(_Lease(-1, lease.worker, share, 0.0), queues, results)
        count = self._requeue(lease, queues, results)
        self._emit("rollout_worker_died", {
            "worker": lease.worker, "lease": lease.lease_id, "groups_requeued": count,
            "workers_alive": sum(self.alive), "error": type(err).__name__,
        })

    def _expire(self, inflight: dict[asyncio.Future[Any], _Lease], queues: list[deque[int]],
                results: dict[int, Group]) -> None:
        now = time.monotonic()
        for lease in inflight.values():
            if not lease.expired and lease.deadline <= now:
                lease.expired = True
                count = self._requeue(lease, queues, results)
                self._emit("lease_expired", {"worker": lease.worker, "lease": lease.lease_id, "groups_requeued": count})

    # ------------------------------------------------------------------ reporting, end

    def take_metrics(self) -> dict[str, float]:
        """Per-worker counts since the last call (the manager adds them to each batch's metrics)."""
        metrics: dict[str, float] = {
            "rollout/workers_alive": float(sum(self.alive)),
            "rollout/leases_requeued": float(self._requeued),
            "rollout/duplicate_results": float(self._duplicates),
        }
        for worker, stats in enumerate(self._stats):
            metrics[f"rollout/worker/{worker}/groups"] = float(stats.groups)
            metrics[f"rollout/worker/{worker}/leases"] = float(stats.leases)
            metrics[f"rollout/worker/{worker}/busy_s"] = stats.busy_s
        self._stats = [_WorkerStats() for _ in self._stats]
        self._requeued = self._duplicates = 0
        return metrics

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(event, fields)

    def close(self) -> None:
        """Kill the workers; stop Ray when this object started it."""
        import ray

        for handle in getattr(self, "workers", []):
            with contextlib.suppress(Exception):  # already dead
                ray.kill(handle)
        self.workers = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def worker_spec(cfg: RunConfig, base_model: Any, *, group: GroupSpec, rewards: Sequence[Any], env: Any) -> WorkerSpec:
    """What each rollout worker of a `[distributed] kind = "ray"` run builds from: its engine's
    device, batch size, threads and kept-cache cap come from `[distributed]`, `[inference]` and
    `[backend]` as the in-process engine's do."""
    import torch

    from rollout.algorithms.rl_common import hf_engine_limits
    from rollout.config import RayDistributedConfig

    dist = cfg.distributed
    assert isinstance(dist, RayDistributedConfig)
    max_batch, kept_cache_bytes = hf_engine_limits(cfg.inference)
    return WorkerSpec(
        model=base_model, group=group, rewards=list(rewards), env=env,
        device="cuda" if dist.num_gpus_per_worker > 0 else "cpu", max_batch_size=max_batch,
        num_threads=cfg.backend.num_threads or torch.get_num_threads(), kept_cache_bytes=kept_cache_bytes,
    )


def build_rollout_engine(
    cfg: RunConfig, base_model: Any, *, group: GroupSpec, rewards: Sequence[Any],
    env: Any, device: Any, weights_dir: Path, run_id: str,
    on_event: Callable[[str, dict[str, Any]], None] | None = None, rank: int = 0,
) -> SamplingEngine | RayRollout | FollowerRollout:
    """The rollout side of an RL run: this process's engine (`build_engine`; each torchrun rank's
    own, made batch-invariant: `rollout.rl.torchrun_rollout`), or, under
    `[distributed] kind = "ray"`, rollout worker actors that make the manager's groups
    (`rollout.rl.ray_rollout`), started by learner 0 of a learner group (`rank`; the others get a
    `FollowerRollout`); each has `sampler`, `weight_sync`, `group_runner` and `close()`."""
    from rollout.algorithms.rl_common import build_engine
    from rollout.config import RayDistributedConfig
    from rollout.rl.ray_learners import FollowerRollout

    dist = cfg.distributed
    if not isinstance(dist, RayDistributedConfig):  # torchrun ranks always sample batch-invariantly
        return build_engine(base_model, inference=cfg.inference, device=device, weights_dir=weights_dir,
                            batch_invariant=cfg.backend.batch_invariant or dist.kind == "torchrun")
    if rank != 0:
        return FollowerRollout()
    spec = worker_spec(cfg, base_model, group=group, rewards=rewards, env=env)
    return RayRollout(
        spec, num_workers=dist.num_rollout_workers, address=dist.address, num_cpus_per_worker=dist.num_cpus_per_worker,
        num_gpus_per_worker=dist.num_gpus_per_worker, max_groups_per_lease=dist.max_groups_per_lease,
        lease_timeout_s=dist.lease_timeout_s, name=f"rollout-{run_id}", on_event=on_event,
    )
