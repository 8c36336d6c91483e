"""GRPO-family advantages and loss against values computed by hand on python floats."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.losses.grpo import (
    compute_group_advantages,
    compute_importance_ratio,
    grpo_loss,
    grpo_normalizer,
)

EPS = 1e-4
CLIP_LOW, CLIP_HIGH = 0.2, 0.28

# Two completions, T = 3: row 0 has 3 tokens, row 1 has 2 (the last position is padding
# holding garbage that must be ignored). Ratios π/π_old per token:
#   row 0, A = +1:   1.1 (inside), 1.5 (above 1 + 0.28: clipped), 0.5 (below, but A > 0: not clipped)
#   row 1, A = -0.5: 0.7 (below 1 - 0.2 with A < 0: clipped), 1.2 (inside)
RATIOS = [[1.1, 1.5, 0.5], [0.7, 1.2, 1.0]]
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -4.0]]
ADV = [1.0, -0.5]
MASK = [[True, True, True], [True, True, False]]
PAD_LOGP = 7.0  # nonsense log-prob at the padded position


def t(values, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=requires_grad)


def example_logps(requires_grad: bool = False) -> torch.Tensor:
    rows = [
        [o + math.log(r) for o, r in zip(orow, rrow, strict=True)]
        for orow, rrow in zip(OLD, RATIOS, strict=True)
    ]
    rows[1][2] = PAD_LOGP
    return t(rows, requires_grad)


def mask() -> torch.Tensor:
    return torch.tensor(MASK)


def run(loss_agg: str = "token_mean", normalizer: float = 5.0, **kwargs):
    kwargs.setdefault("clip_low", CLIP_LOW)
    kwargs.setdefault("clip_high", CLIP_HIGH)
    logps = kwargs.pop("logps", None)
    logps = example_logps() if logps is None else logps
    return grpo_loss(logps, t(OLD), t(ADV), mask(), loss_agg=loss_agg, normalizer=normalizer, **kwargs)


# Hand values of the per-token surrogate −min(r·A, clip(r)·A):
#   row 0: −1.1, −1.28 (clipped at 1.28), −0.5;  row 1: −0.8·(−0.5) = 0.4 (clipped at 0.8), 0.6
ROW0 = [-1.1, -1.28, -0.5]
ROW1 = [0.4, 0.6]


# --- advantages ---------------------------------------------------------------------

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
GROUPS = [9, 9, 9, 9, 4, 4, 4, 4]  # ids need not be 0.. or sorted


def test_group_advantages_group_scale():
    adv = compute_group_advantages(t(REWARDS), torch.tensor(GROUPS), scale_rewards="group")
    # group 9: mean 0.5, Bessel std sqrt((4 · 0.25) / 3) = sqrt(1/3); group 4: all equal -> 0, not NaN
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert adv.dtype == torch.float32


def test_group_advantages_batch_scale():
    adv = compute_group_advantages(t(REWARDS), torch.tensor(GROUPS), scale_rewards="batch")
    # batch mean 0.75; squared deviations 6 · 0.25² + 2 · 0.75² = 1.5; Bessel variance 1.5 / 7
    a = 0.5 / (math.sqrt(1.5 / 7) + EPS)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_group_advantages_no_scale():
    adv = compute_group_advantages(t(REWARDS), torch.tensor(GROUPS), scale_rewards="none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0], abs=1e-7)


def test_group_advantages_interleaved_unequal_groups():
    # group 3: rewards 2, 4, 9 (mean 5); group 1: rewards 1, 3 (mean 2); group 7: a lone 5.0
    rewards = t([2.0, 1.0, 4.0, 3.0, 9.0, 5.0])
    groups = torch.tensor([3, 1, 3, 1, 3, 7])
    adv = compute_group_advantages(rewards, groups, scale_rewards="group")
    std3 = math.sqrt((9 + 1 + 16) / 2)
    std1 = math.sqrt((1 + 1) / 1)
    expected = [
        -3 / (std3 + EPS),
        -1 / (std1 + EPS),
        -1 / (std3 + EPS),
        1 / (std1 + EPS),
        4 / (std3 + EPS),
        0.0,
    ]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_rejects_bad_scale():
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_group_advantages(t([1.0]), torch.tensor([0]), scale_rewards="global")


# --- aggregation ----------------------------------------------------------------------


def test_token_mean_sums_masked_tokens():
    loss, metrics = run("token_mean", normalizer=5.0)
    expected_sum = sum(ROW0) + sum(ROW1)  # -1.88
    assert loss.item() == pytest.approx(expected_sum / 5, rel=1e-5)
    assert metrics["loss_sum"] == pytest.approx(expected_sum, rel=1e-5)
    assert metrics["num_tokens"] == 5.0
    assert metrics["num_seqs"] == 2.0
    assert metrics["ratio_sum"] == pytest.approx(1.1 + 1.5 + 0.5 + 0.7 + 1.2, rel=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.5, rel=1e-6)


def test_seq_mean_averages_each_sequence_first():
    loss, metrics = run("seq_mean", normalizer=2.0)
    expected_sum = sum(ROW0) / 3 + sum(ROW1) / 2  # -0.96 + 0.5
    assert loss.item() == pytest.approx(expected_sum / 2, rel=1e-5)
    assert metrics["loss_sum"] == pytest.approx(expected_sum, rel=1e-5)


def test_dr_grpo_divides_by_sequences_times_max_length():
    max_len = 4
    normalizer = grpo_normalizer("dr_grpo", [mask()], max_len)
    assert normalizer == 2 * 4
    loss, _ = run("dr_grpo", normalizer=normalizer)
    assert loss.item() == pytest.approx((sum(ROW0) + sum(ROW1)) / 8, rel=1e-5)


def test_normalizer_per_aggregation():
    second = torch.tensor([[True, False, False], [False, False, False]])  # one empty row: not a sequence
    masks = [mask(), second]
    assert grpo_normalizer("token_mean", masks, 3) == 6.0
    assert grpo_normalizer("seq_mean", masks, 3) == 3.0
    assert grpo_normalizer("dr_grpo", masks, 3) == 9.0
    with pytest.raises(ValueError, match="max_completion_len"):
        grpo_normalizer("dr_grpo", masks, 2)
    with pytest.raises(ValueError, match="no tokens"):
        grpo_normalizer("token_mean", [torch.zeros(1, 3, dtype=torch.bool)], 3)


# --- clipping -------------------------------------------------------------------------


def test_asymmetric_clip_counts_one_token_above_and_one_below():
    _, metrics = run()
    # 1.5 > 1.28 with A > 0 and 0.7 < 0.8 with A < 0 are clipped; 0.5 with A > 0 is not
    assert metrics["clipped_tokens"] == 2.0


def test_clipped_tokens_get_no_gradient():
    logps = example_logps(requires_grad=True)
    loss, _ = run(logps=logps)
    loss.backward()
    # unclipped tokens: d(−r·A)/d logp = −r·A / normalizer; clipped and padded ones: 0
    expected = [[-1.1 / 5, 0.0, -0.5 / 5], [0.0, 1.2 * 0.5 / 5, 0.0]]
    for got_row, want_row in zip(logps.grad.tolist(), expected, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-6)


# --- KL to the reference ------------------------------------------------------------


def test_k3_kl_term():
    beta = 0.1
    ref = [[-1.2, -1.5, -0.5], [-1.0, -0.3, -9.0]]
    _, no_kl = run()
    loss, metrics = run(beta=beta, ref_logps=t(ref))
    logps = example_logps().tolist()
    k3 = 0.0
    for b in range(2):
        for j in range(3):
            if MASK[b][j]:
                d = ref[b][j] - logps[b][j]
                k3 += math.exp(d) - d - 1
    assert metrics["kl_sum"] == pytest.approx(k3, rel=1e-5)
    assert metrics["loss_sum"] == pytest.approx(no_kl["loss_sum"] + beta * k3, rel=1e-5)
    assert loss.item() == pytest.approx((no_kl["loss_sum"] + beta * k3) / 5, rel=1e-5)


def test_kl_is_reported_without_beta_and_needs_ref_with_beta():
    _, metrics = run()
    assert metrics["kl_sum"] == 0.0
    _, with_ref = run(ref_logps=t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert with_ref["kl_sum"] > 0
    assert with_ref["loss_sum"] == pytest.approx(metrics["loss_sum"], rel=1e-6)  # beta = 0: no KL in the loss
    with pytest.raises(ValueError, match="ref_logps"):
        run(beta=0.1)


# --- GSPO -----------------------------------------------------------------------------


def test_gspo_sequence_ratio_value_and_gradient():
    logps = example_logps(requires_grad=True)
    loss, metrics = run(logps=logps, importance_sampling_level="sequence")
    s0 = math.exp((math.log(1.1) + math.log(1.5) + math.log(0.5)) / 3)  # 0.825^(1/3) ≈ 0.938, inside the clip
    s1 = math.exp((math.log(0.7) + math.log(1.2)) / 2)  # sqrt(0.84) ≈ 0.917, inside the clip
    expected_sum = 3 * (-s0 * 1.0) + 2 * (-s1 * -0.5)
    assert loss.item() == pytest.approx(expected_sum / 5, rel=1e-5)
    assert metrics["ratio_sum"] == pytest.approx(3 * s0 + 2 * s1, rel=1e-5)
    assert metrics["clipped_tokens"] == 0.0
    ratio = compute_importance_ratio(logps, t(OLD), mask(), level="sequence")
    assert ratio.tolist()[0] == pytest.approx([s0] * 3, rel=1e-6)
    # GSPO-token gradient: d s_t / d logp_t = s, so d loss / d logp_t = −A·s / normalizer
    loss.backward()
    expected = [[-s0 / 5] * 3, [0.5 * s1 / 5, 0.5 * s1 / 5, 0.0]]
    for got_row, want_row in zip(logps.grad.tolist(), expected, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-6)


def test_gspo_clips_whole_sequence():
    # row 0's sequence ratio 0.938 lies outside a GSPO-sized range [1 − 3e-4, 1 + 4e-4] but A > 0: kept;
    # row 1's 0.917 is below it with A < 0: all of its tokens are clipped
    _, metrics = run(importance_sampling_level="sequence", clip_low=3e-4, clip_high=4e-4)
    assert metrics["clipped_tokens"] == 2.0


# --- truncated importance sampling ---------------------------------------------------


def test_tis_weight_is_capped_and_weights_only_the_policy_term():
    logps = t(OLD)  # on-policy w.r.t. old, so the surrogate per token is −A
    # exp(old − rollout) = 2.0, 5.0 (capped at 3), 0.5 | 1.0, 0.25
    weights = [[2.0, 5.0, 0.5], [1.0, 0.25, 1.0]]
    rollout = [
        [o - math.log(w) for o, w in zip(orow, wrow, strict=True)]
        for orow, wrow in zip(OLD, weights, strict=True)
    ]
    rollout[1][2] = -50.0  # padding: would be a huge weight if it were not masked
    beta = 0.5
    ref = [[-1.0, -2.0, -0.5], [-1.5, -1.3, -4.0]]  # only token (1, 1) differs: ref − logp = −1
    loss, metrics = grpo_loss(
        logps, t(OLD), t(ADV), mask(),
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, beta=beta, ref_logps=t(ref),
        loss_agg="token_mean", rollout_logps=t(rollout), tis_cap=3.0, normalizer=5.0,
    )  # fmt: skip
    k3 = math.exp(-1.0) + 1.0 - 1.0
    expected_sum = -1.0 * (2.0 + 3.0 + 0.5) + 0.5 * (1.0 + 0.25) + beta * k3
    assert loss.item() == pytest.approx(expected_sum / 5, rel=1e-5)
    assert metrics["is_weight_sum"] == pytest.approx(2.0 + 3.0 + 0.5 + 1.0 + 0.25, rel=1e-5)
    assert metrics["is_capped_tokens"] == 1.0


def test_tis_needs_a_cap():
    with pytest.raises(ValueError, match="tis_cap"):
        run(rollout_logps=t(OLD))


# --- on-policy first step --------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_ratio_is_exactly_one(level):
    logps = t([[-0.3, -2.7, -1.1], [-0.9, -0.4, -5.0]])
    ratio = compute_importance_ratio(logps, logps.clone(), mask(), level=level)
    assert bool((ratio == 1.0).all())
    _, metrics = grpo_loss(
        logps, logps.clone(), t(ADV), mask(), clip_low=0.0, clip_high=0.0, beta=0.04,
        ref_logps=logps.clone(), loss_agg="token_mean", importance_sampling_level=level, normalizer=5.0,
    )  # fmt: skip
    assert metrics["ratio_max"] == 1.0
    assert metrics["ratio_sum"] == metrics["num_tokens"] == 5.0
    assert metrics["clipped_tokens"] == 0.0  # even with a zero-width clip range
    assert metrics["kl_sum"] == 0.0
    assert metrics["loss_sum"] == pytest.approx(-(3 * 1.0 + 2 * -0.5), abs=1e-6)


# --- gradient direction ------------------------------------------------------------------


def test_positive_advantage_pushes_logps_up():
    logps = t([[-0.3, -2.7, -1.1], [-0.9, -0.4, -5.0]], requires_grad=True)
    loss, _ = grpo_loss(
        logps, logps.detach(), t([2.0, -1.0]), mask(), clip_low=0.2, clip_high=0.28,
        loss_agg="seq_mean", normalizer=2.0,
    )  # fmt: skip
    loss.backward()
    grad = logps.grad
    assert bool((grad[0] < 0).all())  # A > 0: descending the loss raises these log-probs
    assert bool((grad[1, :2] > 0).all())  # A < 0: lowers them
    assert float(grad[1, 2]) == 0.0  # padding


# --- micro-batch aggregation ---------------------------------------------------------------


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "dr_grpo"])
def test_micro_batches_sum_to_the_full_batch(loss_agg):
    old = t([[-1.0, -2.0, -0.5], [-1.5, -0.3, -4.0], [-0.2, -0.9, -1.0], [-2.0, -1.0, -3.0]])
    logps_values = [[-0.9, -2.2, -0.4], [-1.7, -0.1, 0.0], [-0.2, 3.0, 3.0], [-2.1, -1.1, -2.9]]
    adv = t([1.0, -0.5, 2.0, -1.0])
    full_mask = torch.tensor(
        [[True, True, True], [True, True, False], [True, False, False], [True, True, True]]
    )
    kwargs = dict(clip_low=0.2, clip_high=0.28, beta=0.1, ref_logps=old, loss_agg=loss_agg)

    full_logps = t(logps_values, requires_grad=True)
    normalizer = grpo_normalizer(loss_agg, [full_mask], 3)
    full_loss, _ = grpo_loss(full_logps, old, adv, full_mask, normalizer=normalizer, **kwargs)
    full_loss.backward()

    split_logps = t(logps_values, requires_grad=True)
    halves = [slice(0, 2), slice(2, 4)]
    assert grpo_normalizer(loss_agg, [full_mask[h] for h in halves], 3) == normalizer
    total = 0.0
    for h in halves:
        mb_kwargs = {**kwargs, "ref_logps": old[h]}
        mb_loss, _ = grpo_loss(
            split_logps[h], old[h], adv[h], full_mask[h], normalizer=normalizer, **mb_kwargs
        )
        mb_loss.backward()
        total += mb_loss.item()
    assert total == pytest.approx(full_loss.item(), rel=1e-6)
    assert torch.allclose(split_logps.grad, full_logps.grad, atol=1e-7)
