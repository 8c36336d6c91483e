"""Loss metrics are read back from the device once a micro-batch, after the backward is queued.

Counted on the CPU with a `TorchDispatchMode`: `_local_scalar_dense` is what `float()`, `item()`,
`int()` and `bool()` of a tensor dispatch, and a boolean mask's indexing reads the mask's count;
on a GPU each of them makes the host wait for the device. `Tensor.tolist` dispatches nothing on the
CPU, so it is counted by wrapping it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from readbacks import Waits

from rollout.backends.torch_backend import TorchBackend
from rollout.losses.grpo import grpo_loss, grpo_loss_terms
from rollout.losses.metrics import read_metrics
from rollout.losses.ppo import ppo_loss, ppo_loss_terms


@pytest.fixture
def tolist_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = torch.Tensor.tolist

    def counted(t: torch.Tensor) -> Any:
        calls.append(t.numel())
        return original(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return calls


def rl_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[3] = False  # a row with no token
    old = -torch.rand(shape, generator=g) * 3
    return {
        "logps": (old + 0.3 * torch.randn(shape, generator=g)).requires_grad_(),
        "old_logps": old,
        "ref_logps": old + 0.2 * torch.randn(shape, generator=g),
        "rollout_logps": old + 0.2 * torch.randn(shape, generator=g),
        "mask": mask,
        "advantages": torch.randn(shape[0], generator=g),
    }


def grpo_kwargs(x: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(clip_low=0.2, clip_high=0.28, beta=0.04, ref_logps=x["ref_logps"], loss_agg="token_mean",
                rollout_logps=x["rollout_logps"], tis_cap=2.0, normalizer=10.0)


def ppo_args(x: dict[str, torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
    values = x["old_logps"].neg().requires_grad_()
    returns = torch.ones_like(values)
    advantages = x["advantages"].unsqueeze(-1).expand_as(values)
    return ((x["logps"], x["old_logps"], advantages, values, x["old_logps"].neg() + 0.1, returns, x["mask"]),
            dict(clip_ratio=0.2, clip_value=0.2, vf_coef=0.1, normalizer=10.0))


def test_the_rl_losses_compute_their_metrics_without_waiting_for_the_device():
    x = rl_inputs()
    with Waits() as waits:
        grpo_loss_terms(x["logps"], x["old_logps"], x["advantages"], x["mask"], **grpo_kwargs(x))
        args, kwargs = ppo_args(x)
        ppo_loss_terms(*args, **kwargs)
    assert waits.counts == {}


def test_the_metrics_are_the_masked_sums_and_maximum_they_name():
    """Against boolean indexing, the way they were computed before (each a device wait)."""
    x = rl_inputs()
    mask = x["mask"]
    _, m = grpo_loss(x["logps"], x["old_logps"], x["advantages"], mask, **grpo_kwargs(x))
    ratio = torch.exp(x["logps"].detach() - x["old_logps"])
    kl = torch.exp(x["ref_logps"] - x["logps"].detach()) - (x["ref_logps"] - x["logps"].detach()) - 1
    weight = torch.exp(x["old_logps"] - x["rollout_logps"]).clamp(max=2.0)
    assert m["num_tokens"] == float(mask.sum()) and m["num_seqs"] == 3.0
    assert m["ratio_sum"] == pytest.approx(float(ratio[mask].sum()), rel=1e-6)
    assert m["ratio_max"] == pytest.approx(float(ratio[mask].max()), rel=1e-6)
    assert m["kl_sum"] == pytest.approx(float(kl[mask].sum()), rel=1e-5)
    assert m["is_weight_sum"] == pytest.approx(float(weight[mask].sum()), rel=1e-6)
    args, kwargs = ppo_args(x)
    _, p = ppo_loss(*args, **kwargs)
    assert p["ratio_sum"] == pytest.approx(float(ratio[mask].sum()), rel=1e-6)
    assert p["approx_kl_sum"] == pytest.approx(float(((ratio - 1) - ratio.log())[mask].sum()), rel=1e-4)
    assert all(type(v) is float for v in (*m.values(), *p.values()))


def test_a_batch_without_tokens_reports_zeros():
    x = rl_inputs()
    none = torch.zeros_like(x["mask"])
    _, m = grpo_loss(x["logps"], x["old_logps"], x["advantages"], none, **grpo_kwargs(x))
    assert (m["num_tokens"], m["ratio_max"], m["ratio_sum"], m["kl_sum"], m["is_weight_sum"]) == (0, 0, 0, 0, 0)
    empty = torch.zeros(2, 0)
    _, m = grpo_loss(empty, empty, torch.ones(2), empty.bool(), clip_low=0.2, clip_high=0.2,
                     loss_agg="token_mean", normalizer=1.0)  # fmt: skip
    assert m["ratio_max"] == 0.0 and m["num_tokens"] == 0.0


def test_read_metrics_reads_every_tensor_in_one_transfer_keeping_order_and_counts(tolist_calls):
    metrics = {"a": 1.5, "count": torch.tensor(2**40 + 1), "sum": torch.tensor(0.25), "b": 2, "flag": torch.tensor(True)}
    with Waits() as waits:
        out = read_metrics(metrics)
    assert out == {"a": 1.5, "count": float(2**40 + 1), "sum": 0.25, "b": 2.0, "flag": 1.0}
    assert list(out) == list(metrics)
    assert tolist_calls == [3] and waits.counts == {}
    assert read_metrics({"x": 3.0}) == {"x": 3.0} and tolist_calls == [3]  # no tensor: no transfer
    with pytest.raises(ValueError, match="'v' has 2 elements"):
        read_metrics({"v": torch.ones(2)})


def test_the_backend_reads_a_micro_batch_s_metrics_once_after_its_backward(tolist_calls):
    model = torch.nn.Linear(3, 1)
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), None,  # type: ignore[arg-type]
                           device=torch.device("cpu"), max_grad_norm=None)  # fmt: skip
    seen: list[bool] = []

    def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        out = m(batch).sum()
        seen.append(m.weight.grad is None)  # no backward yet
        return out, {"loss_sum": out.detach(), "rows": batch.shape[0], "max": batch.max()}

    metrics = asyncio.run(backend.forward_backward(torch.ones(2, 3), loss_fn))
    assert seen == [True] and model.weight.grad is not None
    with torch.no_grad():
        expected = float(model(torch.ones(2, 3)).sum())
    assert metrics == {"loss_sum": pytest.approx(expected), "rows": 2.0, "max": 1.0}
    assert tolist_calls == [2]
