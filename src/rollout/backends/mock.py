"""A deterministic training backend with no torch, for orchestration tests.

It keeps a small vector of float "parameters" and moves them by a gradient
derived from a digest of each batch, so two runs fed the same batches in the
same order end with identical parameters — and any change in batch order,
resume or accumulation shows up in them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rollout.backends.base import BackendState, LossFn, OptimStepResult


class MockBackend:
    def __init__(self, *, num_params: int = 8, lr: float = 0.1, seed: int = 0) -> None:
        self.lr = lr
        self.params = [((seed * 7919 + i * 104729) % 1000) / 1000.0 for i in range(num_params)]
        self._grad = [0.0] * num_params
        self.steps = 0

    async def forward_backward(self, batch: Any, loss_fn: LossFn[Any] | None = None) -> dict[str, float]:
        digest = hashlib.blake2b(repr(batch).encode(), digest_size=len(self.params)).digest()
        target = [b / 255.0 for b in digest]
        loss = sum((p - t) ** 2 for p, t in zip(self.params, target, strict=False)) / len(self.params)
        for i, (p, t) in enumerate(zip(self.params, target, strict=False)):
            self._grad[i] += 2.0 * (p - t) / len(self.params)
        return {"loss_sum": loss, "num_targets": 1.0}

    async def zero_gradients(self) -> None:
        pass  # the accumulated gradient is already a zero vector until a forward_backward

    async def optim_step(self) -> OptimStepResult:
        norm = sum(g * g for g in self._grad) ** 0.5
        self.params = [p - self.lr * g for p, g in zip(self.params, self._grad, strict=False)]
        self._grad = [0.0] * len(self.params)
        self.steps += 1
        return OptimStepResult(grad_norm=norm, lr=self.lr)

    async def state(self) -> BackendState:
        blob = json.dumps({"params": [float.hex(p) for p in self.params]}).encode()
        return BackendState(blobs={"model": blob}, meta={"steps": self.steps, "lr": self.lr})

    async def load_state(self, state: BackendState) -> None:
        self.params = [float.fromhex(p) for p in json.loads(bytes(state.blobs["model"]))["params"]]
        self._grad = [0.0] * len(self.params)
        self.steps = int(state.meta["steps"])

    async def export_weights(self) -> Mapping[str, Any]:
        return {"params": list(self.params)}
