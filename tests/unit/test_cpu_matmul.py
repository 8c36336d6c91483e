"""`[backend] cpu_matmul = "onednn"`: the lean decoder's and the LM head's CPU products in oneDNN,
forward and backward, the same math as `F.linear` to float rounding; the default is `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.errors import ConfigError
from rollout.models import cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def onednn():
    cpu_matmul.set_cpu_matmul("onednn")
    yield
    cpu_matmul.set_cpu_matmul("torch")


def _grads(fn, x, w, b):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    out = fn(x, w, b)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(cpu_matmul.MIN_ROWS + 9, 48), (3, cpu_matmul.MIN_ROWS // 2, 48)])
def test_onednn_linear_matches_f_linear_forward_and_backward(onednn, bias, shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(40, 48, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    assert "OneDNN" in type(cpu_matmul.linear(x.clone().requires_grad_(), w, b).grad_fn).__name__
    ours = _grads(cpu_matmul.linear, x, w, b)
    ref = _grads(F.linear, x, w, b)
    for a, r in zip(ours, ref, strict=True):
        if r is None:
            assert a is None
            continue
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    assert ours[1].abs().sum() > 0 and ours[2].abs().sum() > 0  # gradients reached the input and the weight


def test_the_setting_picks_the_library_and_leaves_other_tensors_to_f_linear(onednn):
    x, w = torch.randn(cpu_matmul.MIN_ROWS, 8), torch.randn(3, 8)
    assert cpu_matmul.linear(x, w).grad_fn is None  # no input needs grad
    few = cpu_matmul.linear(torch.randn(cpu_matmul.MIN_ROWS - 1, 8, requires_grad=True), w)
    assert "OneDNN" not in type(few.grad_fn).__name__  # a decode step's few rows: F.linear
    assert type(cpu_matmul.linear(x.requires_grad_(), w).grad_fn).__name__ == "_OneDNNLinearBackward"
    assert "Addmm" not in type(cpu_matmul.linear(x.double(), w.double()).grad_fn).__name__  # float64: F.linear
    assert cpu_matmul.linear(torch.randn(0, 8), w).shape == (0, 3)  # no rows: F.linear
    head = torch.nn.Linear(8, 3)
    torch.testing.assert_close(cpu_matmul.project(head, x), head(x))
    assert "OneDNN" in type(cpu_matmul.project(head, x).grad_fn).__name__
    seen = []
    head.register_forward_pre_hook(lambda *a: seen.append(1))  # e.g. FSDP's unsharding: the module is called
    assert "OneDNN" not in type(cpu_matmul.project(head, x).grad_fn).__name__ and seen == [1]
    cpu_matmul.set_cpu_matmul("torch")
    assert "OneDNN" not in type(cpu_matmul.linear(x, w).grad_fn).__name__


def test_an_unknown_kind_is_refused_and_a_build_without_onednn_is_a_config_error(monkeypatch):
    with pytest.raises(ValueError, match="cpu_matmul must be one of torch, onednn"):
        cpu_matmul.set_cpu_matmul("mkl")
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN linear"):
        cpu_matmul.set_cpu_matmul("onednn")
    assert cpu_matmul.cpu_matmul() == "torch"


def test_a_lean_training_step_through_onednn_gives_f_linears_loss_and_gradients(onednn, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rollout.data.collate import TokenBatch
    from rollout.losses.logps import sequence_logps
    from rollout.models.tiny import init_tiny_model

    model = AutoModelForCausalLM.from_pretrained(init_tiny_model(tmp_path / "m"), attn_implementation="sdpa")
    rows, length = 12, 16  # 192 rows a projection, 180 through the head: over MIN_ROWS
    assert rows * (length - 1) >= cpu_matmul.MIN_ROWS
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                       position_ids=torch.arange(length).expand(rows, length), attention_mask=torch.ones_like(ids),
                       sample_index=torch.arange(rows)[:, None].expand(rows, length), num_tokens=rows * length,
                       num_loss_tokens=rows * (length - 1))

    def step():
        model.zero_grad(set_to_none=True)
        logps, _ = sequence_logps(model, batch)
        logps.sum().backward()
        return logps.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    apply = cpu_matmul._OneDNNLinear.apply
    monkeypatch.setattr(cpu_matmul._OneDNNLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    ours = step()
    assert len(calls) == 4 * 7 + 1  # every projection of the 4 layers, and the head
    cpu_matmul.set_cpu_matmul("torch")
    ref = step()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    for a, r in zip(ours[1], ref[1], strict=True):  # each parameter's gradient, to float rounding
        assert float((a - r).norm()) <= 1e-5 * float(r.norm())
