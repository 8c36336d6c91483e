"""The `TrainingBackend` protocol (SPEC section 7).

A backend owns the model, optimizer and scheduler. Algorithms hand it a batch
and a loss function; every call returns an awaitable so generation and
training can be pipelined. Backends: `torch` (one device, CPU or CUDA) and
`mock` (deterministic, no torch, for orchestration tests); under torchrun, the torch
backend's contract over FSDP2 or DDP (`rollout.distributed.DistributedBackend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

BatchT = TypeVar("BatchT", contravariant=True)


class LossFn(Protocol[BatchT]):
    """`loss_fn(model, batch) -> (loss, metrics)`: runs the forward pass and a pure loss. A metric
    is a float or a detached 0-dim tensor; a torch backend reads the tensors back together after
    the backward (`rollout.losses.metrics.read_metrics`), and `forward_backward` returns floats."""

    def __call__(self, model: Any, batch: BatchT) -> tuple[Any, Mapping[str, Any]]: ...


@dataclass(frozen=True)
class BackendState:
    """Everything needed to continue training bit-identically.

    `blobs` are opaque bytes (safetensors for the torch backend) stored in the
    object store; `meta` is JSON-able (optimizer hyper-parameters, scheduler,
    RNG states) and `tensors` describes each tensor blob (dtype/shape) for the
    snapshot manifest.
    """

    blobs: Mapping[str, bytes]
    meta: Mapping[str, Any]
    tensors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepResult:
    grad_norm: float
    lr: float


class TrainingBackend(Protocol[BatchT]):
    async def forward_backward(self, batch: BatchT, loss_fn: LossFn[BatchT]) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate until `optim_step`."""
        ...

    async def optim_step(self) -> OptimStepResult:
        """Clip, step the optimizer and scheduler, zero the gradients."""
        ...

    async def zero_gradients(self) -> None:
        """A zero gradient for every trainable parameter, as the backward of a loss whose gradient is
        exactly zero would leave, without the passes: the `optim_step` after it still moves the
        optimizer's state (momentum, weight decay) and the schedule."""
        ...

    async def state(self) -> BackendState: ...

    async def load_state(self, state: BackendState) -> None: ...

    async def export_weights(self) -> Mapping[str, Any]:
        """The model's weights by name (LoRA merged), e.g. to push to an inference engine."""
        ...
