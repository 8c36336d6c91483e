"""A loss's metrics read back from the device in one transfer.

Every `float(tensor)` of a CUDA tensor, and every boolean-mask index (its size is read), makes the
host wait until the device has run everything queued before it: a loss that reads its eight
metrics one by one, between its forward and its backward, waits eight times and leaves the device
idle while the host queues the backward. A loss function may instead return its metrics as
detached 0-dim tensors; the backend reads them all with `read_metrics`, once, after queuing the
backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import ParamSpec

import torch

P = ParamSpec("P")

Metric = float | torch.Tensor
"""A metric value: a Python number, or a 0-dim tensor still on the device."""


def read_metrics(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """`metrics` as floats, its tensors read back in one transfer (float64, so that counts up to
    2**53 stay exact). A metric whose tensor has more than one element is refused."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    for name, t in tensors.items():
        if t.numel() != 1:
            raise ValueError(f"metric {name!r} has {t.numel()} elements, not one")
    values = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors.values()]).tolist() if tensors else []
    read = dict(zip(tensors, values, strict=True))
    return {k: read[k] if k in read else float(v) for k, v in metrics.items()}


def read_back(
    terms: Callable[P, tuple[torch.Tensor, Mapping[str, Metric]]],
) -> Callable[P, tuple[torch.Tensor, dict[str, float]]]:
    """A loss whose metrics are tensors (`terms`), as a loss whose metrics are floats."""

    @functools.wraps(terms)
    def loss(*args: P.args, **kwargs: P.kwargs) -> tuple[torch.Tensor, dict[str, float]]:
        value, metrics = terms(*args, **kwargs)
        return value, read_metrics(metrics)

    return loss
