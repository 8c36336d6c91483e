"""TorchBackend's step: the mode it trains in, and what it leaves in .grad."""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from rollout.backends.torch_backend import build_torch_backend


def _backend(model: nn.Module):
    return build_torch_backend(
        model, device=torch.device("cpu"), total_steps=10, max_grad_norm=1.0,
        optimizer={"kind": "sgd", "lr": 0.1}, scheduler={"kind": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0},
    )


def test_forward_backward_trains_every_module_in_training_mode():
    """Every step trains with dropout on: after an evaluation put the model in eval mode, and when only
    a submodule is in eval mode under a training root -- what peft's wrapper of a `from_pretrained`
    model is (the root is built training, the wrapped model comes back from loading in eval mode).
    Checking the root's flag alone to skip `train()` missed that case and trained LoRA without its
    dropout (caught by test_eval_during_training.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Dropout(0.5)))
    backend = _backend(model)
    seen: list[tuple[bool, bool, int]] = []

    def loss_fn(m: nn.Module, batch: torch.Tensor):
        out = m(batch)
        seen.append((m.training, m[1][0].training, int((out == 0).sum())))
        return out.sum(), {}

    x = torch.ones(4, 8)
    model.eval()
    asyncio.run(backend.forward_backward(x, loss_fn))
    model[1].eval()  # a submodule in eval mode under a training root
    assert model.training
    asyncio.run(backend.forward_backward(x, loss_fn))
    model.eval()  # e.g. `eval.during_training` between steps
    asyncio.run(backend.forward_backward(x, loss_fn))
    model[1][0].eval()  # a leaf two levels down, its parents training
    asyncio.run(backend.forward_backward(x, loss_fn))
    assert [(a, b) for a, b, _ in seen] == [(True, True)] * 4
    assert all(zeros > 0 for _, _, zeros in seen)  # dropout zeroed some of the 32 outputs each time


def test_forward_backward_accumulates_and_optim_step_clears():
    """Two micro-batches add their gradients; the optimizer step applies the clipped sum and clears .grad."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    backend = _backend(model)

    def loss_fn(m: nn.Module, batch: torch.Tensor):
        return m(batch).sum(), {}

    asyncio.run(backend.forward_backward(torch.tensor([[0.3, 0.0]]), loss_fn))
    asyncio.run(backend.forward_backward(torch.tensor([[0.0, 0.4]]), loss_fn))
    assert torch.equal(model.weight.grad, torch.tensor([[0.3, 0.4]]))  # norm 0.5: under the clip of 1.0
    result = asyncio.run(backend.optim_step())
    assert abs(result.grad_norm - 0.5) < 1e-7 and result.lr == 0.1
    assert torch.allclose(model.weight, torch.tensor([[1.0 - 0.03, -1.0 - 0.04]]))
    assert model.weight.grad is None
