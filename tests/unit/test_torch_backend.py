"""TorchBackend's step: the mode it trains in, and what it leaves in .grad."""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from rollout.backends.torch_backend import build_torch_backend, clip_grad_norm


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


def _grads(scale: float) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Two copies of the same parameters with the same gradients (norm ~`scale`), for two clips."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 11, 2)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))

    def copy() -> list[nn.Parameter]:
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, x in zip(params, grads, strict=True):
            p.grad = x * (scale / total)
        return params

    return copy(), copy()


def test_clip_grad_norm_matches_torch_bit_for_bit_and_leaves_unclipped_gradients_unwritten():
    """`clip_grad_norm` returns torch's total norm and leaves torch's gradient bits, clipped or not;
    when nothing is clipped on the CPU it does not write the gradients at all (their version counters
    stay), where torch multiplies them by 1.0."""
    for scale, limit, clipped in ((3.0, 1.0, True), (0.5, 1.0, False),
                                  (2.0, float("inf"), False), (1.0 - 1e-7, 1.0 - 2e-7, True)):
        ours, theirs = _grads(scale)
        versions = [p.grad._version for p in ours]
        norm = clip_grad_norm(ours, limit)
        expected = torch.nn.utils.clip_grad_norm_(theirs, limit, foreach=True)
        assert torch.equal(norm, expected), (scale, limit)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.grad, b.grad), (scale, limit)
        written = [p.grad._version != v for p, v in zip(ours, versions, strict=True)]
        assert written == [clipped] * 3, (scale, limit, written)
        if clipped:
            assert not torch.equal(ours[0].grad, _grads(scale)[0][0].grad)  # the clip did scale them


def test_clip_grad_norm_passes_a_non_finite_norm_on_as_torch_does():
    """A NaN gradient: the same NaN norm and NaN-multiplied gradients as torch's clip."""
    ours, theirs = _grads(1.0)
    for params in (ours, theirs):
        params[1].grad[0] = float("nan")
    norm = clip_grad_norm(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
    assert torch.isnan(norm) and torch.isnan(expected)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad.isnan(), b.grad.isnan()) and torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())
    assert clip_grad_norm([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0  # no gradients: norm 0
