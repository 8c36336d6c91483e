"""Several learner processes over torch.distributed: the torchrun launch, the process group, the
data split, FSDP2 / DDP, and gathering the full state.

    [distributed]
    kind = "torchrun"
    nproc_per_node = 2          # ranks on this host: gloo on CPU, NCCL on CUDA
    sharding = "fsdp"           # FSDP2 `fully_shard` (default) or "ddp"

    rollout train sft --config run.toml            # relaunches itself through torch.distributed.run
    torchrun --nproc-per-node 2 -m rollout.cli.main train sft --config run.toml   # the same, by hand

The launch. `rollout train` with `kind = "torchrun"`, when not already under a launcher (no
`RANK`/`WORLD_SIZE` in its environment), runs `python -m torch.distributed.run
--nproc-per-node N [--nnodes M --rdzv-endpoint H:P | --standalone] -m rollout.cli.main train
<kind> --config F [--resume ID]` and exits with its status (`rollout.launch`). torchrun's own
failure handling stops the other ranks when one exits; the launcher then marks the run `failed`
if rank 0 could not (rank 0 tells it the run id through the file `$ROLLOUT_RUN_ID_FILE`). Under
a bare `torchrun`, rank 0 turns torchrun's SIGTERM into an error (the run is marked failed), and a
SIGKILLed rank 0 leaves a run without heartbeats that `rollout runs` marks `crashed`.

The numbers. Every rank plans the same global batch a single process would (the data plan is
deterministic); each micro-batch's rows are split into equal contiguous slices, one per rank
(`Distributed.shard`). Losses are normalised by the *global* count (`Distributed.sum` of the
ranks' counts) and the ranks' gradients are summed (FSDP2: gradient divide factor 1 with sum
reductions; DDP averages, so its loss is scaled by the world size), so the gradient is the
single-process gradient up to float reassociation: per-step losses agree to ~1e-7. The data
cursor stays global. GRPO's batch is sampled, not planned: each rank samples its share of the
groups and the ranks exchange them (`rollout.rl.torchrun_rollout`, `all_gather_1d`), then every
rank holds the whole batch and trains on its slice of each micro-batch; `export_weights` gives
every rank the full weights for its engine.

The model. `wrap_for_training` puts the model under a `LossStep` module whose forward runs a loss
function on it, so the wrapper's hooks see every forward although the recipes' loss functions call
the model's parts (decoder, head) directly. `fsdp`: FSDP2 on every transformer block
(`_no_split_modules`) and on the `LossStep` root (embeddings, final norm and head: tied weights
stay in one unit); it runs on CPU over gloo with torch >= 2.13. `ddp`: each rank holds everything
(LoRA runs only here: its reference is the policy with adapters disabled, called outside the
wrapper).

The state. Only rank 0 writes to the store and the object store; the others get a `NullRecorder`
and read the run's row and snapshots. A snapshot holds the full state in the single-process
layout (model by name, optimizer state by parameter index), gathered onto rank 0 under FSDP2
(`torch.distributed.checkpoint.state_dict`), so a run resumes at any world size, or in one process.
Eval during training and the export run on rank 0, on a full copy under FSDP2 (`gathered_model`).
On several hosts every rank must reach the store and the object store (PostgreSQL, an object
store all hosts share): the other ranks read the run's row and the resume snapshot from them.
Tested with 2 gloo ranks on one host (tests/distributed); several hosts and NCCL are untested.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from rollout.errors import ConfigError, DistributedError

if TYPE_CHECKING:
    import torch

    from rollout.backends.torch_backend import TorchBackend
    from rollout.config import DistributedConfig, RunConfig

T = TypeVar("T")

RUN_ID_FILE_ENV = "ROLLOUT_RUN_ID_FILE"
"""Set by `launch_torchrun`: the file rank 0 writes the run id into (so the launcher can mark the
run failed when a rank dies)."""

Sharding = Literal["fsdp", "ddp"]


# --------------------------------------------------------------------------- launch


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun (or another torch.distributed launcher) started this process."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def announce_run(run_id: str) -> None:
    """Rank 0: tell the launcher (if it asked) which run this job is."""
    path = os.environ.get(RUN_ID_FILE_ENV)
    if path:
        Path(path).write_text(run_id)


def check_torchrun(cfg: RunConfig, *, source: Path) -> None:
    """Plan-time checks of a torchrun config: each micro-batch splits evenly over the ranks, and
    LoRA asks for DDP (as does PPO: its policy and value models are not sharded together); GRPO's
    and PPO's ranks sample with the hf engine, on-policy (a batch generated ahead would exchange
    groups while the ranks train), and every reward scores a group on its own."""
    from rollout.config import TorchrunDistributedConfig
    from rollout.config_base import located_error

    dist, kind, s = cfg.distributed, cfg.algorithm.kind, cfg.algorithm.settings
    assert isinstance(dist, TorchrunDistributedConfig)
    world = dist.nproc_per_node * dist.nnodes
    samples = kind in ("grpo", "ppo")
    if s.minibatch_size % world:
        what = "prompts" if samples else "rows"
        how = "each rank samples an equal share of a step's prompts" if samples else (
            "each micro-batch is shared out evenly")
        raise located_error(
            source, ["algorithm", kind, "minibatch_size"],
            f"{s.minibatch_size} {what} do not split over {world} ranks (nproc_per_node x nnodes):"
            f" {how}, so use a multiple of the world size",
        )
    _check_fsdp_sharding(cfg, source=source)
    if not samples:
        return
    if cfg.inference is not None and cfg.inference.engine != "hf":
        raise located_error(source, ["inference", "engine"],
                            f'torchrun ranks sample with the hf engine, not "{cfg.inference.engine}" (kind = "torchrun")')
    if s.off_policy_steps:
        raise located_error(
            source, ["algorithm", kind, "off_policy_steps"],
            'generating the next batch while training is not implemented under kind = "torchrun" (use 0)',
        )
    _check_group_rewards(cfg, source=source, where="torchrun rank")


def check_ray(cfg: RunConfig, *, source: Path, find_spec: Any = None) -> None:
    """Plan-time checks of a `kind = "ray"` config (`rollout.rl.ray_rollout`): Ray is installed,
    the workers' engine is hf, and every reward scores a group on its own (a reward model
    normalised over a batch or a running mean would see each worker's share instead)."""
    import importlib.util

    from rollout.config_base import located_error

    if (find_spec or importlib.util.find_spec)("ray") is None:
        raise located_error(
            source, ["distributed", "kind"],
            '"ray" needs Ray, which is not installed: pip install "rollout[ray]" (or "ray[default]>=2.40,<3")',
        )
    if cfg.inference is not None and cfg.inference.engine != "hf":
        raise located_error(source, ["inference", "engine"],
                            f'rollout workers run the hf engine, not "{cfg.inference.engine}" (kind = "ray")')
    _check_group_rewards(cfg, source=source, where="rollout worker")
    dist, kind, s = cfg.distributed, cfg.algorithm.kind, cfg.algorithm.settings
    if dist.num_learners == 1:
        return
    if kind not in ("grpo", "ppo"):
        raise located_error(source, ["distributed", "num_learners"],
                            f"a learner actor group trains grpo and ppo; {kind} trains in one learner process (use 1)")
    _check_fsdp_sharding(cfg, source=source)
    if s.off_policy_steps:
        raise located_error(
            source, ["algorithm", kind, "off_policy_steps"],
            "generating the next batch while training is not implemented with num_learners > 1 (use 0)",
        )


def _check_fsdp_sharding(cfg: RunConfig, *, source: Path) -> None:
    """What FSDP2 (`sharding = "fsdp"`, torchrun's ranks or Ray's learners) does not train yet:
    LoRA adapters, and PPO's policy and value models together."""
    from rollout.config_base import located_error

    if cfg.distributed.sharding != "fsdp":
        return
    if cfg.algorithm.settings.lora is not None:
        raise located_error(
            source, ["distributed", "sharding"], 'LoRA runs under sharding = "ddp" only (FSDP2 + LoRA is not implemented)'
        )
    if cfg.algorithm.kind == "ppo":
        raise located_error(source, ["distributed", "sharding"],
                            'ppo runs under sharding = "ddp" (FSDP2 of its policy and value models together is not'
                            ' implemented)')


def _check_group_rewards(cfg: RunConfig, *, source: Path, where: str) -> None:
    """Every reward model scores a group on its own (not normalised over a batch or a running
    mean: each {where} sees only its share) and is loaded from a folder."""
    from rollout.config_base import located_error

    kind, s, dist = cfg.algorithm.kind, cfg.algorithm.settings, cfg.distributed.kind
    for i, entry in enumerate(getattr(s, "rewards", ())):
        if getattr(entry, "kind", "function") != "reward_model":
            continue
        if entry.normalize in ("batch", "running"):
            raise located_error(
                source, ["algorithm", kind, "rewards", str(i), "normalize"],
                f'"{entry.normalize}" normalises over what one process scores, which differs per {where}'
                f' under kind = "{dist}" (use "group" or "none")',
            )
        if entry.snapshot is not None:
            raise located_error(source, ["algorithm", kind, "rewards", str(i), "snapshot"],
                                f'a {where} loads a reward model from its folder (model = "...") under kind = "{dist}"')


# --------------------------------------------------------------------------- the process group


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job: rank `rank` of `world_size` (rank 0 of 1 when local)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharding: Sharding | None = None
    """None for a local run (no process group); else how the model is spread over the ranks."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group exists (kind = "torchrun", at any world size)."""
        return self.sharding is not None

    def shard(self, rows: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of a global micro-batch's rows (all of them when local)."""
        n, w = len(rows), self.world_size
        if n % w:
            raise DistributedError(f"a micro-batch of {n} rows does not split over {w} ranks")
        k = n // w
        return list(rows[self.rank * k : (self.rank + 1) * k])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64), the same on every rank."""
        if not self.active:
            return [float(v) for v in values]
        import torch
        import torch.distributed as tdist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        tdist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maxima over the ranks (float64), the same on every rank."""
        if not self.active:
            return [float(v) for v in values]
        import torch
        import torch.distributed as tdist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

    def all_gather_1d(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D `tensor` (lengths may differ; one dtype), in rank order, on the CPU, on
        every rank: the lengths first, then the tensors padded to the longest (no pickle)."""
        if not self.active:
            return [tensor]
        import torch
        import torch.distributed as tdist

        device = self._comm_device()
        size = torch.tensor([tensor.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        tdist.all_gather(sizes, size)
        lengths = [int(n.item()) for n in sizes]
        longest = max(1, *lengths)  # gloo: no empty tensors
        padded = torch.zeros(longest, dtype=tensor.dtype, device=device)
        padded[: tensor.numel()] = tensor.to(device)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        tdist.all_gather(out, padded)
        return [t[:n].cpu() for t, n in zip(out, lengths, strict=True)]

    def broadcast_text(self, text: str) -> str:
        """Rank 0's `text` on every rank (ids: short ASCII)."""
        if not self.active:
            return text
        import torch
        import torch.distributed as tdist

        data = text.encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._comm_device())
        tdist.broadcast(size, src=0)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._comm_device())
        if self.is_rank0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        tdist.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).decode()

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as tdist

            tdist.barrier()

    def close(self) -> None:
        if self.active:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()

    def _comm_device(self) -> str:
        import torch.distributed as tdist

        return f"cuda:{self.local_rank}" if tdist.get_backend() == "nccl" else "cpu"


LOCAL = Distributed()


def join_process_group(dist: DistributedConfig, *, device: Literal["auto", "cpu", "cuda"]) -> Distributed:
    """This process's `Distributed`: `LOCAL` for kind = "local" and for "ray" with one learner
    (this process; the rollout workers are Ray actors); under torchrun, or in a Ray learner actor
    (`rollout.rl.ray_learners` sets the same variables), the process group joined (NCCL on CUDA,
    gloo on CPU) with the config's collective timeout."""
    under = under_launcher()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.kind == "local" or (dist.kind == "ray" and dist.num_learners == 1):
        if under and world > 1:
            raise ConfigError(
                f'started by a launcher with WORLD_SIZE={world} but [distributed] kind = "{dist.kind}":'
                ' set kind = "torchrun" (or start one process)'
            )
        return LOCAL
    if not under:
        how = ("`rollout train` (which launches torchrun) or torchrun" if dist.kind == "torchrun" else
               "`rollout train` (which starts the learner actors)")
        raise ConfigError(f'[distributed] kind = "{dist.kind}": start it with {how}')
    import torch
    import torch.distributed as tdist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank)  # "cuda" in the recipes means this rank's device from now on
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=dist.timeout_s))
    if rank == 0 and threading.current_thread() is threading.main_thread():
        # torchrun SIGTERMs the ranks still alive when one fails: end the run as failed, not silently
        signal.signal(signal.SIGTERM, _terminated)
    return Distributed(rank=rank, world_size=world, local_rank=local_rank, sharding=dist.sharding)


def _terminated(signum: int, frame: Any) -> None:
    raise DistributedError("terminated by SIGTERM (torchrun stops every rank when one of them fails)")


class NullRecorder:
    """The recorder of ranks other than 0: they write nothing (rank 0 records the run)."""

    def event(self, name: str, **fields: object) -> None:
        pass

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the model under FSDP2 / DDP


def _loss_step_class() -> type:
    import torch

    class LossStep(torch.nn.Module):
        """The module torch.distributed wraps: `forward(batch, loss_fn)` runs `loss_fn(model, batch)`."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: Any, loss_fn: Any) -> Any:
            return loss_fn(self.model, batch)

    return LossStep


def wrap_for_training(model: torch.nn.Module, dist: Distributed) -> torch.nn.Module:
    """`LossStep(model)` under FSDP2 (`model`'s parameters become sharded DTensors, in place) or DDP."""
    import torch
    import torch.distributed as tdist

    from rollout.models.load import hf_model

    step = _loss_step_class()(model)
    if dist.sharding == "ddp":
        # buffers (rotary tables) are the same on every rank: no sync in each forward
        return torch.nn.parallel.DistributedDataParallel(step, forward_sync_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device_type = "cuda" if tdist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dist.world_size,))
    blocks = set(getattr(hf_model(model), "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(step, mesh=mesh)
    for module in step.modules():
        if isinstance(module, FSDPModule):  # sum the ranks' gradients (each loss is over the global count)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return step


def full_state_dict(model: torch.nn.Module, dist: Distributed) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with full tensors on CPU: gathered onto rank 0 under FSDP2 (a collective:
    every rank calls it; the others get {}); under DDP or locally, rank 0's own copy."""
    if dist.sharding != "fsdp":
        return {k: v.detach() for k, v in model.state_dict().items()} if dist.is_rank0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextmanager
def gathered_model(model: Any, dist: Distributed) -> Iterator[Any]:
    """`model` with full weights on rank 0 (None on the other ranks), for eval and export. Under
    FSDP2 every rank must enter (the gather is a collective) and rank 0 gets a rebuilt full copy;
    otherwise `model` itself."""
    if dist.sharding != "fsdp":
        yield model if dist.is_rank0 else None
        return
    import copy

    import torch

    from rollout.models.load import hf_model

    state = full_state_dict(model, dist)
    if not dist.is_rank0:
        yield None
        return
    base = hf_model(model)  # (no LoRA under FSDP2: check_torchrun refuses it)
    full = type(base)._from_config(base.config, attn_implementation=base.config._attn_implementation, dtype=base.dtype)
    full.generation_config = copy.deepcopy(base.generation_config)
    full.load_state_dict(state)
    yield full.to(torch.device(dist._comm_device()))  # this rank's device: cuda:LOCAL_RANK or the CPU


# --------------------------------------------------------------------------- the backend


class DistributedBackend:
    """The `torch` backend's contract over a process group: the model under FSDP2 or DDP, its
    optimizer and lr schedule; `state()` gathers the full single-process-layout state onto rank 0."""

    def __init__(
        self, model: torch.nn.Module, step: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, *, device: torch.device, max_grad_norm: float | None,
        dist: Distributed,
    ) -> None:
        self.model = model  # the recipe's model; its parameters are sharded DTensors under FSDP2
        self.step = step
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.dist = dist
        self._params = [p for p in model.parameters() if p.requires_grad]

    async def forward_backward(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        from rollout.backends.torch_backend import move_to
        from rollout.losses.metrics import read_metrics

        self.step.train()
        loss, metrics = self.step(move_to(batch, self.device), loss_fn)
        # The loss is over the global count, so the ranks' gradients must be summed: FSDP2 sums
        # (divide factor 1); DDP averages, so its loss is scaled by the world size. (A summing comm
        # hook would not do: DDP reduces the accumulated .grad again at each micro-batch.)
        (loss * self.dist.world_size if self.dist.sharding == "ddp" else loss).backward()
        return read_metrics(metrics)  # after the backward is queued: one read-back

    async def zero_gradients(self) -> None:  # (each rank its own shards under FSDP2)
        import torch

        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    async def optim_step(self) -> Any:
        from rollout.backends.base import OptimStepResult
        from rollout.backends.torch_backend import clip_grad_norm

        lr = self.optimizer.param_groups[0]["lr"]
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        grad_norm = clip_grad_norm(self._params, limit)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2 (replicated: the global norm)
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return OptimStepResult(grad_norm=float(grad_norm), lr=float(lr))

    async def state(self) -> Any:
        """The full state on rank 0 (every rank must call it under FSDP2); an empty state elsewhere."""
        from safetensors.torch import save as save_safetensors

        from rollout.backends.base import BackendState
        from rollout.backends.torch_backend import _describe, _flatten_optimizer_state, _unshared
        from rollout.rng import capture_rng_state

        model_tensors = full_state_dict(self.model, self.dist)
        opt_state = self._full_optimizer_state()
        if not self.dist.is_rank0:
            return BackendState(blobs={}, meta={})
        model_tensors = _unshared(model_tensors)
        opt_tensors, opt_meta = _flatten_optimizer_state(opt_state)
        return BackendState(
            blobs={"model": save_safetensors(model_tensors), "optimizer": save_safetensors(opt_tensors)},
            meta={"optimizer": opt_meta, "scheduler": self.scheduler.state_dict(), "rng": capture_rng_state()},
            tensors={"model": _describe(model_tensors), "optimizer": _describe(opt_tensors)},
        )

    async def load_state(self, state: Any) -> None:
        """Every rank loads the full state (read from the snapshot) and keeps its shard."""
        from safetensors.torch import load as load_safetensors

        from rollout.backends.torch_backend import _unflatten_optimizer_state
        from rollout.rng import restore_rng_state

        model_tensors = load_safetensors(bytes(state.blobs["model"]))
        opt_state = _unflatten_optimizer_state(
            load_safetensors(bytes(state.blobs["optimizer"])), state.meta["optimizer"]
        )
        if self.dist.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # The ranks scatter tensor by tensor in the dict's order, so every rank must use the same
            # one: the model's (safetensors' `load` order differs between processes).
            order = list(self.model.state_dict())
            model_tensors = {k: model_tensors[k] for k in order if k in model_tensors} | model_tensors
            options = StateDictOptions(full_state_dict=True, strict=True)
            set_model_state_dict(self.model, model_tensors, options=options)
            set_optimizer_state_dict(self.model, self.optimizer, self._by_name(opt_state), options=options)
        else:
            missing, unexpected = self.model.load_state_dict(model_tensors, strict=False)
            if missing or unexpected:
                raise ValueError(f"snapshot does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
            self.optimizer.load_state_dict(opt_state)
        self.scheduler.load_state_dict(dict(state.meta["scheduler"]))
        restore_rng_state(dict(state.meta["rng"]))

    async def export_weights(self) -> dict[str, Any]:
        """The full weights on every rank (a collective under FSDP2: each rank's rollout engine
        samples with them); LoRA adapters (DDP only) merged into a copy."""
        if self.dist.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        model = self.model
        if hasattr(model, "merge_and_unload"):  # peft: merge the adapters into a copy
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        return {k: v.detach() for k, v in model.state_dict().items()}

    def forward_frozen(self, batch: Any, fn: Any) -> Any:
        """`fn(model, batch)` without grad through the wrapper (FSDP2 gathers the parameters for
        it): old log-probs of a batch this rank trains on. Every rank calls it as often."""
        import torch

        from rollout.backends.torch_backend import move_to

        with torch.no_grad():
            return self.step(move_to(batch, self.device), fn)

    # -- optimizer state: by parameter index (torch's own layout, what one process saves) ------

    def _param_names(self) -> list[str]:
        """The optimizer's parameters' names, in the order torch numbers them in its state dict."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def _full_optimizer_state(self) -> dict[str, Any]:
        if self.dist.sharding != "fsdp":
            return self.optimizer.state_dict() if self.dist.is_rank0 else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        by_name = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not self.dist.is_rank0:
            return {}
        index = {name: i for i, name in enumerate(self._param_names())}
        return {
            "state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]],
        }

    def _by_name(self, opt_state: Mapping[str, Any]) -> dict[str, Any]:
        names = self._param_names()
        state = opt_state["state"]  # in one order on every rank (tensors are scattered in dict order)
        return {
            "state": {names[int(i)]: dict(sorted(state[i].items())) for i in sorted(state, key=int)},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in opt_state["param_groups"]],
        }


def build_backend(
    model: torch.nn.Module, dist: Distributed, *, device: torch.device, total_steps: int,
    max_grad_norm: float | None, optimizer: Mapping[str, Any], scheduler: Mapping[str, Any],
    param_groups: Sequence[dict[str, Any]] | None = None,
) -> TorchBackend | DistributedBackend:
    """`build_torch_backend` for a local run; under torchrun the model wrapped first (FSDP2 replaces
    the parameters), then the optimizer over the wrapped parameters. `param_groups` (torch's form)
    replaces `model.parameters()`; DDP keeps the parameters, so its groups are the same objects."""
    from rollout.backends.torch_backend import (
        build_torch_backend,
        lr_multiplier,
        make_lr_schedule,
        make_optimizer,
    )

    if not dist.active:
        return build_torch_backend(
            model, device=device, total_steps=total_steps, max_grad_norm=max_grad_norm, optimizer=optimizer,
            scheduler=scheduler, param_groups=param_groups,
        )
    if dist.sharding == "fsdp" and param_groups is not None:
        raise ConfigError("parameter groups (ppo's value_lr) under sharding = \"fsdp\" are not supported: use \"ddp\"")
    if dist.sharding == "fsdp" and hasattr(model, "peft_config"):
        raise ConfigError('LoRA under [distributed] sharding = "fsdp" is not supported yet: use sharding = "ddp"')
    step = wrap_for_training(model, dist)
    opt = make_optimizer(param_groups if param_groups is not None else model.parameters(), **optimizer)
    sched = make_lr_schedule(opt, lambda i: lr_multiplier(i, total_steps=total_steps, **scheduler))
    return DistributedBackend(model, step, opt, sched, device=device, max_grad_norm=max_grad_norm, dist=dist)
