import math

import pytest
import torch

from rollout.backends.torch_backend import lr_multiplier, make_lr_schedule, make_optimizer


def test_warmup_is_linear_and_never_zero():
    got = [lr_multiplier(i, kind="constant", warmup_steps=3, total_steps=10, min_lr_ratio=0.0) for i in range(5)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_and_linear_decay_to_min_ratio():
    kw = dict(warmup_steps=0, total_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(5, kind="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(10, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(5, kind="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(50, kind="linear", **kw) == pytest.approx(0.1)


def test_lambda_schedule_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer([p], kind="sgd", lr=0.2)
    sched = make_lr_schedule(opt, lambda i: lr_multiplier(i, kind="linear", warmup_steps=1, total_steps=3, min_lr_ratio=0.0))
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.1])


def test_param_groups_keep_their_own_peak_lr_under_one_schedule():
    """PPO's `value_lr`: the value model's group has its own peak lr; the schedule scales both groups."""
    policy, value = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    opt = make_optimizer([{"params": [policy, frozen]}, {"params": [value], "lr": 3e-3}], kind="adamw", lr=1e-3)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]  # frozen parameters are left out
    sched = make_lr_schedule(opt, lambda i: lr_multiplier(i, kind="cosine", warmup_steps=0, total_steps=2,
                                                         min_lr_ratio=0.1))
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-4, 3e-4])


def test_adamw_is_fused_for_plain_float_parameters_and_matches_the_reference_update():
    """One fused kernel per parameter (the fast path on CPU); the update is AdamW's, to float
    rounding: the same parameters as torch's single-tensor reference implementation after 20 steps."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    opt = make_optimizer(a, kind="adamw", lr=1e-2, weight_decay=0.1)
    assert opt.defaults["fused"] is True
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(20):
        grads = [torch.randn_like(x) for x in a]
        for x, y, g in zip(a, b, grads, strict=True):
            x.grad, y.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    groups = make_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1e-4}], kind="adamw", lr=1e-3)
    assert groups.defaults["fused"] is True
    # no fused kernel on other devices (and for sharded parameters): the foreach path
    assert make_optimizer([torch.nn.Parameter(torch.zeros(2, device="meta"))], kind="adamw", lr=1e-3).defaults["foreach"]
