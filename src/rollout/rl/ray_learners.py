"""A learner actor group on Ray: `[distributed] kind = "ray"` with `num_learners` > 1 (GRPO, PPO).

    [distributed]
    kind = "ray"
    num_learners = 2             # learner actors: one torch.distributed process group (gloo on CPU)
    sharding = "fsdp"            # or "ddp", as under torchrun (PPO: "ddp")
    num_rollout_workers = 2      # rollout worker actors, as with one learner

    rollout train grpo --config run.toml

`rollout train` (this process, the driver) connects to Ray (`address`), starts `num_learners`
`Learner` actors and waits for them. Each actor is a rank as under torchrun: it gets `RANK`,
`WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (learner 0's node and a port free there) and runs
the algorithm's recipe, which joins the process group (`rollout.distributed.join_process_group`)
and trains its slice of every micro-batch under FSDP2 or DDP, the gradients summed over the ranks.
Learner 0 starts the rollout worker actors and hands them the round's groups
(`rollout.rl.ray_rollout`: leases, work stealing, versioned weights); the other learners receive
each round from it (`Rank0Groups`, the exchange torchrun's ranks use), so every learner holds
the batch one process would have, and a step is one process's step up to float reassociation
(tests/distributed/test_ray.py). Learner 0 alone writes to the store and the object store; the
driver prints its `TrainResult`.

Failure. The driver waits on every learner; when one fails or dies, the others are killed at
once (a rank waiting on a collective would otherwise wait `timeout_s`), the run is marked
`failed` if learner 0 could not do it (learner 0 names the run through `$ROLLOUT_RUN_ID_FILE`
when it shares the driver's file system), and the error is raised here: a learner's own
`RolloutError` as itself (exit 2), anything else as a `DistributedError` naming the learner.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.distributed import RUN_ID_FILE_ENV, Distributed
from rollout.errors import DistributedError, RolloutError
from rollout.progress import LOG_ENV
from rollout.rl.manager import Group, RoundItem

if TYPE_CHECKING:
    from rollout.algorithms.registry import TrainResult
    from rollout.config import RayDistributedConfig, RunConfig


class Learner:
    """One learner (a Ray actor): a torch.distributed rank running the algorithm's recipe."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the process group's store (learner 0)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def train(self, config: str, resume: str | None, env: dict[str, str]) -> TrainResult | None:
        """The recipe as rank `env["RANK"]` on the run config's canonical JSON (validated again here:
        the config classes are this process's own, so the run's config digest is the driver's);
        its result on rank 0, None on the others."""
        from rollout.algorithms.registry import ALGORITHMS
        from rollout.config import RunConfig

        os.environ.update(env)
        cfg = RunConfig.model_validate(json.loads(config), context={"base_dir": Path.cwd()})  # paths: absolute
        result = ALGORITHMS[cfg.algorithm.kind].load_train()(cfg, resume=resume)
        return result if env["RANK"] == "0" else None


def run_learner_group(cfg: RunConfig, resume: str | None) -> TrainResult:
    """Start the learner actors, wait for them, and return learner 0's result (module docstring)."""
    import ray

    from rollout.launch import end_orphaned_run

    dist: RayDistributedConfig = cfg.distributed  # type: ignore[assignment]  # run_training checked the kind
    owns_ray = not ray.is_initialized()
    if owns_ray:
        connect_ray(dist)
    actor = ray.remote(Learner)
    group = uuid.uuid4().hex[:12]  # `ray list actors` shows rollout-learners-<group>-<rank>
    learners = [
        actor.options(  # type: ignore[attr-defined]
            name=f"rollout-learners-{group}-{rank}", num_cpus=dist.num_cpus_per_learner,
            num_gpus=dist.num_gpus_per_learner, max_restarts=0, max_task_retries=0,
        ).remote()
        for rank in range(dist.num_learners)
    ]
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-learners-") as tmp:
            id_file = Path(tmp) / "run-id"
            address, port = ray.get(learners[0].rendezvous.remote())
            futures = [
                learner.train.remote(cfg.canonical_json(), resume, {
                    "RANK": str(rank), "WORLD_SIZE": str(dist.num_learners), "LOCAL_RANK": "0",
                    "MASTER_ADDR": address, "MASTER_PORT": str(port), RUN_ID_FILE_ENV: str(id_file),
                    **({LOG_ENV: os.environ[LOG_ENV]} if LOG_ENV in os.environ else {}),  # learner 0's progress
                })
                for rank, learner in enumerate(learners)
            ]
            try:
                return _wait_for(futures, learners, cfg, id_file)
            except KeyboardInterrupt:
                for learner in learners:
                    ray.kill(learner)
                end_orphaned_run(cfg, id_file, "cancelled", "interrupted")
                raise
    finally:
        for learner in learners:
            ray.kill(learner)
        if owns_ray:
            ray.shutdown()


def connect_ray(dist: RayDistributedConfig) -> None:
    """`ray.init` for the config's `address`: "local" starts an instance with room for every
    learner and rollout worker (at least this machine's CPUs). The actors' output reaches this
    terminal (learner 0's progress lines, prefixed by Ray with `(Learner pid=...)`)."""
    import math

    import ray

    if dist.address == "local":
        wanted = dist.num_learners * dist.num_cpus_per_learner + dist.num_rollout_workers * dist.num_cpus_per_worker
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(wanted)), include_dashboard=False, log_to_driver=True,
                 logging_level="WARNING")
    else:
        ray.init(address=dist.address, log_to_driver=True, logging_level="WARNING")


def _wait_for(futures: list[Any], learners: list[Any], cfg: RunConfig, id_file: Path) -> TrainResult:
    """Learner 0's result once every learner returned; the first failure ends them all."""
    import ray
    import ray.exceptions

    from rollout.launch import end_orphaned_run

    pending = list(futures)
    while pending:
        [done], pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayError as err:
            for learner in learners:  # a rank blocked on a collective would wait timeout_s
                ray.kill(learner)
            rank = futures.index(done)
            cause = getattr(err, "cause", None)
            message = f"learner {rank} failed: {type(cause or err).__name__}: {cause or err}"
            end_orphaned_run(cfg, id_file, "failed", message)  # unless learner 0 ended it itself
            if isinstance(cause, RolloutError):
                raise cause from None
            raise DistributedError(message) from None
    result: TrainResult = ray.get(futures[0])
    return result


class Rank0Groups:
    """The manager's `GroupRunner` on a learner actor: learner 0 makes the round with the rollout
    workers (`runner`), and every learner gets it from there (`exchange_groups`: the same decoded
    samples on every rank, learner 0's own included)."""

    def __init__(self, runner: Any, dist: Distributed) -> None:
        assert (runner is not None) == dist.is_rank0, "learner 0 alone runs the rollout workers"
        self.runner = runner
        self.dist = dist

    async def run_groups(self, items: Sequence[RoundItem], policy_version: int) -> list[Group]:
        from rollout.rl.torchrun_rollout import exchange_groups

        made = await self.runner.run_groups(items, policy_version) if self.dist.is_rank0 else []
        groups = exchange_groups(made, self.dist)[0]
        assert [g[0].group_id for g in groups] == [gid for _, _, gid in items], "learner 0 made other groups"
        return groups

    def take_metrics(self) -> dict[str, float]:
        take = getattr(self.runner, "take_metrics", None)
        return take() if take is not None else {}


class FollowerRollout:
    """The rollout side of learners other than 0: no engine and no workers (learner 0's
    `Rank0Groups` hands them each round); the weights they export are not pushed anywhere."""

    keeps_serving = False
    sampler = None
    group_runner = None

    @property
    def weight_sync(self) -> FollowerRollout:
        return self

    def push(self, weights: Any, *, version: int) -> None:
        pass

    def close(self) -> None:
        pass
