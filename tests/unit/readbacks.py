"""`Waits`, imported by the unit tests (`from readbacks import Waits`): counts, on the CPU, the
operations that would make the host wait for a device. `_local_scalar_dense` is what `float()`,
`item()`, `int()` and `bool()` of a tensor dispatch; a boolean mask's indexing, `nonzero` and
`masked_select` read a count."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Waits(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.counts[name] += 1
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.counts["boolean index"] += 1
        return func(*args, **(kwargs or {}))
