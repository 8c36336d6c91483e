"""Losses against values computed by hand from their formulas."""

import math

import pytest
import torch

from rollout.losses.rm import bradley_terry_loss
from rollout.losses.sft import next_token_targets, sft_loss


def test_sft_loss_is_summed_cross_entropy_over_normalizer():
    # row 0: uniform over 2 classes -> ln 2; row 1: p(target)=3/4 -> -ln 0.75
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    targets = torch.tensor([0, 0])
    loss, metrics = sft_loss(logits, targets, normalizer=4.0)
    expected_sum = math.log(2.0) - math.log(0.75)
    assert loss.item() == pytest.approx(expected_sum / 4.0, abs=1e-7)
    assert metrics["loss_sum"] == pytest.approx(expected_sum, abs=1e-6)
    assert metrics["num_targets"] == 2.0


def test_sft_loss_rejects_zero_normalizer():
    with pytest.raises(ValueError):
        sft_loss(torch.zeros(1, 2), torch.tensor([0]), normalizer=0)


def test_next_token_targets_respect_packed_segments():
    # one row packing two samples: [a b c | d e] with positions reset at d
    ids = torch.tensor([[10, 11, 12, 20, 21]])
    mask = torch.tensor([[False, True, True, False, True]])  # first token of each sample is never a target
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    valid, targets = next_token_targets(ids, mask, pos)
    # position t predicts t+1: valid at t=0 (->11), t=1 (->12), t=3 (->21); not t=2 (->20 is a new segment)
    assert valid.tolist() == [[True, True, False, True]]
    assert targets[valid].tolist() == [11, 12, 21]
    # even if a segment start were marked as a target, the position check keeps it out
    valid2, _ = next_token_targets(ids, torch.ones_like(mask), pos)
    assert valid2.tolist() == [[True, True, False, True]]


def test_bradley_terry_matches_hand_values():
    rc = torch.tensor([2.0, 0.0])
    rr = torch.tensor([0.0, 1.0])
    loss, m = bradley_terry_loss(rc, rr, normalizer=2.0)
    # -log σ(2) = log(1 + e^-2); -log σ(-1) = log(1 + e^1)
    expected = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2.0
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["correct"] == 1.0 and m["num_pairs"] == 2.0
    assert m["reward_chosen_sum"] == 2.0 and m["reward_rejected_sum"] == 1.0


def test_bradley_terry_margin_and_centering():
    rc, rr = torch.tensor([2.0]), torch.tensor([0.0])
    loss, _ = bradley_terry_loss(rc, rr, normalizer=1.0, margin=1.0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # -log σ(2 - 0 - 1)
    loss, _ = bradley_terry_loss(rc, rr, normalizer=1.0, margin=torch.tensor([0.5]), center_coefficient=0.01)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.5)) + 0.01 * 4.0, abs=1e-6)


def test_bradley_terry_gradient_pushes_rewards_apart():
    rc = torch.tensor([0.0], requires_grad=True)
    rr = torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(rc, rr, normalizer=1.0)
    loss.backward()
    # d/d rc of -log σ(rc - rr) at 0 is -(1 - σ(0)) = -0.5
    assert rc.grad.item() == pytest.approx(-0.5) and rr.grad.item() == pytest.approx(0.5)
