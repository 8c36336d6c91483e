"""DPO-family and KTO losses against values computed by hand from the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.losses.logps import average_logps
from rollout.losses.preference import (
    LENGTH_AVERAGED_LOSS_TYPES,
    dpo_loss,
    kl_completion_order,
    kto_kl_estimate,
    kto_loss,
)

# Three pairs. Chosen log-ratios π_c − ref_c = 0.5, −0.2, 1.0; rejected log-ratios
# π_r − ref_r = −0.2, 0.5, −0.5; so h = 0.7, −0.7, 1.5.
PI_C, PI_R = [-5.0, -3.0, -1.0], [-6.0, -2.5, -4.0]
REF_C, REF_R = [-5.5, -2.8, -2.0], [-5.8, -3.0, -3.5]
BETA = 0.5


def logsigmoid(x: float) -> float:
    return -math.log(1.0 + math.exp(-x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def hand_h() -> list[float]:
    return [(pc - rc) - (pr - rr) for pc, pr, rc, rr in zip(PI_C, PI_R, REF_C, REF_R, strict=True)]


def t(values: list[float], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=requires_grad)


def run_dpo(loss_type: str, label_smoothing: float = 0.0, normalizer: float = 3.0, beta: float = BETA):
    return dpo_loss(
        t(PI_C),
        t(PI_R),
        t(REF_C),
        t(REF_R),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        normalizer=normalizer,
    )


# --- DPO ----------------------------------------------------------------------------


def test_sigmoid_matches_hand_values():
    loss, metrics = run_dpo("sigmoid")
    expected = [-logsigmoid(BETA * h) for h in hand_h()]  # 0.7, -0.7, 1.5
    assert float(loss) == pytest.approx(sum(expected) / 3, rel=1e-6)
    assert metrics["loss_sum"] == pytest.approx(sum(expected), rel=1e-6)
    assert metrics["num_pairs"] == 3.0


def test_sigmoid_label_smoothing_is_conservative_dpo():
    eps = 0.2
    loss, _ = run_dpo("sigmoid", label_smoothing=eps)
    expected = [-(1 - eps) * logsigmoid(BETA * h) - eps * logsigmoid(-BETA * h) for h in hand_h()]
    assert float(loss) == pytest.approx(sum(expected) / 3, rel=1e-6)


def test_robust_matches_hand_values():
    eps = 0.1
    loss, _ = run_dpo("robust", label_smoothing=eps)
    expected = [
        (-(1 - eps) * logsigmoid(BETA * h) + eps * logsigmoid(-BETA * h)) / (1 - 2 * eps) for h in hand_h()
    ]
    assert float(loss) == pytest.approx(sum(expected) / 3, rel=1e-6)


def test_robust_without_smoothing_is_sigmoid():
    assert float(run_dpo("robust")[0]) == pytest.approx(float(run_dpo("sigmoid")[0]), rel=1e-7)


def test_hinge_matches_hand_values():
    loss, _ = run_dpo("hinge", beta=1.0)
    expected = [max(0.0, 1 - h) for h in hand_h()]  # h = 0.7, -0.7, 1.5 -> 0.3, 1.7, 0
    assert expected[2] == 0.0
    assert float(loss) == pytest.approx(sum(expected) / 3, rel=1e-6)


def test_hinge_is_zero_with_zero_gradient_when_beta_h_at_least_one():
    pi_c = t([0.0, 0.0], requires_grad=True)
    # beta * h = 1.0 and 2.0
    loss, _ = dpo_loss(
        pi_c, t([-2.0, -4.0]), t([0.0, 0.0]), t([0.0, 0.0]), beta=0.5, loss_type="hinge", normalizer=2
    )
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(pi_c.grad, torch.zeros(2))


def test_ipo_with_length_averaged_logps():
    assert {"ipo"} == LENGTH_AVERAGED_LOSS_TYPES
    counts = torch.tensor([2, 4, 5, 3])  # chosen rows 0..1 then rejected rows 0..1
    summed = t([-4.0, -6.0, -7.5, -3.0])
    ref_summed = t([-5.0, -5.0, -8.0, -3.6])
    avg = average_logps(summed, counts)
    ref_avg = average_logps(ref_summed, counts)
    loss, _ = dpo_loss(avg[:2], avg[2:], ref_avg[:2], ref_avg[2:], beta=BETA, loss_type="ipo", normalizer=2)

    c = [2, 4, 5, 3]
    a = [-4.0 / c[0], -6.0 / c[1], -7.5 / c[2], -3.0 / c[3]]
    r = [-5.0 / c[0], -5.0 / c[1], -8.0 / c[2], -3.6 / c[3]]
    h = [(a[0] - r[0]) - (a[2] - r[2]), (a[1] - r[1]) - (a[3] - r[3])]
    expected = [(x - 1 / (2 * BETA)) ** 2 for x in h]
    assert float(loss) == pytest.approx(sum(expected) / 2, rel=1e-6)


def test_average_logps_guards_empty_rows():
    assert average_logps(t([-3.0, 0.0]), torch.tensor([2, 0])).tolist() == [-1.5, 0.0]


def test_dpo_metrics_are_sums():
    _, metrics = run_dpo("sigmoid")
    chosen = [BETA * (pc - rc) for pc, rc in zip(PI_C, REF_C, strict=True)]  # 0.25, -0.1, 0.5
    rejected = [BETA * (pr - rr) for pr, rr in zip(PI_R, REF_R, strict=True)]  # -0.1, 0.25, -0.25
    assert metrics["reward_chosen_sum"] == pytest.approx(sum(chosen), abs=1e-6)
    assert metrics["reward_rejected_sum"] == pytest.approx(sum(rejected), abs=1e-6)
    assert metrics["margin_sum"] == pytest.approx(sum(chosen) - sum(rejected), abs=1e-6)
    assert metrics["correct"] == 2.0  # pairs 0 and 2


def test_micro_batches_aggregate_exactly():
    full, full_metrics = run_dpo("sigmoid", normalizer=3)
    first, m1 = dpo_loss(
        t(PI_C[:2]), t(PI_R[:2]), t(REF_C[:2]), t(REF_R[:2]), beta=BETA, loss_type="sigmoid", normalizer=3
    )
    second, m2 = dpo_loss(
        t(PI_C[2:]), t(PI_R[2:]), t(REF_C[2:]), t(REF_R[2:]), beta=BETA, loss_type="sigmoid", normalizer=3
    )
    assert float(first + second) == pytest.approx(float(full), rel=1e-6)
    for key in full_metrics:
        assert m1[key] + m2[key] == pytest.approx(full_metrics[key], rel=1e-6, abs=1e-7)


def test_policy_equal_to_reference_gives_log_two_and_zero_margins():
    logps = t([-3.0, -7.25, -1.5])
    loss, metrics = dpo_loss(
        logps, logps - 1.0, logps, logps - 1.0, beta=0.1, loss_type="sigmoid", normalizer=3
    )
    assert float(loss) == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["margin_sum"] == 0.0
    assert metrics["reward_chosen_sum"] == metrics["reward_rejected_sum"] == 0.0
    assert metrics["correct"] == 0.0


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing"),
    [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)],
)
def test_gradient_signs(loss_type, label_smoothing):
    # h = -0.7 for pair 1: every loss is active there (ipo: h < 1/(2β); hinge: βh < 1).
    pi_c, pi_r = t(PI_C, requires_grad=True), t(PI_R, requires_grad=True)
    loss, _ = dpo_loss(
        pi_c,
        pi_r,
        t(REF_C),
        t(REF_R),
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        normalizer=3,
    )
    loss.backward()
    assert float(pi_c.grad[1]) < 0  # raising the chosen log-prob lowers the loss
    assert float(pi_r.grad[1]) > 0  # raising the rejected log-prob raises it
    if loss_type == "ipo":  # IPO regresses h to 1/(2β) = 1: pair 2 (h = 1.5) overshoots and is pulled back
        assert float(pi_c.grad[0]) < 0 and float(pi_c.grad[2]) > 0
        assert float(pi_r.grad[0]) > 0 and float(pi_r.grad[2]) < 0
    else:
        assert torch.all(pi_c.grad <= 0) and torch.all(pi_r.grad >= 0)


def test_dpo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="label_smoothing"):
        run_dpo("robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        run_dpo("ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        run_dpo("kto")
    with pytest.raises(ValueError, match="normalizer"):
        run_dpo("sigmoid", normalizer=0)
    with pytest.raises(ValueError, match="beta"):
        run_dpo("sigmoid", beta=0.0)


# --- KTO ----------------------------------------------------------------------------

K_PI = [-4.0, -6.0, -3.0, -5.0]
K_REF = [-4.5, -5.5, -3.0, -5.4]  # r = 0.5, -0.5, 0.0, 0.4
K_LABELS = [True, False, True, False]


def run_kto(kl: float, w_d: float = 1.0, w_u: float = 1.5, beta: float = BETA):
    return kto_loss(
        t(K_PI),
        t(K_REF),
        torch.tensor(K_LABELS),
        torch.tensor(kl),
        beta=beta,
        desirable_weight=w_d,
        undesirable_weight=w_u,
        normalizer=4,
    )


def hand_kto(z0: float, w_d: float, w_u: float) -> list[float]:
    out = []
    for pi, ref, label in zip(K_PI, K_REF, K_LABELS, strict=True):
        r = pi - ref
        out.append(w_d * (1 - sigmoid(BETA * (r - z0))) if label else w_u * (1 - sigmoid(BETA * (z0 - r))))
    return out


def test_kto_both_classes_and_weights():
    loss, metrics = run_kto(0.3, w_d=1.0, w_u=1.5)
    expected = hand_kto(0.3, 1.0, 1.5)
    assert float(loss) == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert metrics["loss_sum"] == pytest.approx(sum(expected), rel=1e-6)
    assert metrics["num_desirable"] == 2.0 and metrics["num_undesirable"] == 2.0
    assert metrics["reward_desirable_sum"] == pytest.approx(BETA * (0.5 + 0.0), abs=1e-6)
    assert metrics["reward_undesirable_sum"] == pytest.approx(BETA * (-0.5 + 0.4), abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.3)

    heavier, _ = run_kto(0.3, w_d=2.0, w_u=0.5)
    assert float(heavier) == pytest.approx(sum(hand_kto(0.3, 2.0, 0.5)) / 4, rel=1e-6)


def test_kto_clamps_negative_kl_to_zero():
    loss, metrics = run_kto(-0.7)
    assert metrics["kl"] == 0.0
    assert float(loss) == pytest.approx(sum(hand_kto(0.0, 1.0, 1.5)) / 4, rel=1e-6)


def test_kto_gradient_signs_and_detached_reference_point():
    pi = t(K_PI, requires_grad=True)
    kl = torch.tensor(0.3, requires_grad=True)
    loss, _ = kto_loss(
        pi,
        t(K_REF),
        torch.tensor(K_LABELS),
        kl,
        beta=BETA,
        desirable_weight=1.0,
        undesirable_weight=1.0,
        normalizer=4,
    )
    loss.backward()
    assert torch.all(pi.grad[[0, 2]] < 0)  # desirable: raise its log-prob
    assert torch.all(pi.grad[[1, 3]] > 0)  # undesirable: lower it
    assert kl.grad is None  # z0 is detached


def test_kto_kl_estimate_is_clamped_detached_mean():
    pi = t([-3.0, -4.0, -5.0], requires_grad=True)
    est = kto_kl_estimate(pi, t([-3.5, -4.5, -4.7]))  # diffs 0.5, 0.5, -0.3
    assert float(est) == pytest.approx((0.5 + 0.5 - 0.3) / 3, rel=1e-6)
    assert not est.requires_grad
    assert float(kto_kl_estimate(t([-3.0, -4.0]), t([-2.0, -3.5]))) == 0.0  # mean -0.75 -> 0


def test_kl_completion_order_rotates_like_trl():
    # TRL: KL_completion_ids = [c[-1]] + c[:-1] -> prompt i gets completion i - 1 (mod n)
    assert kl_completion_order(4) == [3, 0, 1, 2]
    assert kl_completion_order(2) == [1, 0]
    with pytest.raises(ValueError):
        kl_completion_order(1)
