"""PPO pieces (KL-penalised rewards, GAE, whitening, clipped losses) against hand arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.losses.ppo import compute_gae, kl_penalized_rewards, ppo_loss, whiten


def t(values, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=requires_grad)


# Row 0 has 3 tokens, row 1 has 2 and one padded position holding garbage.
MASK = torch.tensor([[True, True, True], [True, True, False]])


def rows_approx(got: torch.Tensor, want: list[list[float]], abs_tol: float = 1e-6) -> None:
    for got_row, want_row in zip(got.tolist(), want, strict=True):
        assert got_row == pytest.approx(want_row, abs=abs_tol)


# --- rewards --------------------------------------------------------------------------


def test_kl_penalized_rewards_put_the_score_on_the_last_token():
    logps = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, 9.0]])
    ref = t([[-1.5, -1.0, -0.5], [-0.1, -1.2, -9.0]])
    rewards = kl_penalized_rewards(t([1.0, -2.0]), logps, ref, MASK, kl_coef=0.1)
    # −0.1 · (logp − ref): row 0: −0.05, +0.1, 0 (+ score 1.0); row 1: +0.02, 0 (+ score −2.0), pad 0
    rows_approx(rewards, [[-0.05, 0.1, 1.0], [0.02, -2.0, 0.0]])


def test_kl_penalized_rewards_need_a_token_per_row():
    empty = torch.tensor([[True, False], [False, False]])
    with pytest.raises(ValueError, match="at least one"):
        kl_penalized_rewards(t([1.0, 1.0]), torch.zeros(2, 2), torch.zeros(2, 2), empty, kl_coef=0.1)


# --- GAE ------------------------------------------------------------------------------


def test_gae_hand_unrolled():
    gamma, lam = 0.9, 0.8
    rewards = t([[0.1, -0.2, 1.0], [0.0, 2.0, 9.0]])
    values = t([[0.5, 0.4, 0.3], [0.2, 0.6, 7.0]])
    advantages, returns = compute_gae(rewards, values, MASK, gamma=gamma, lam=lam)

    # row 0, backwards from the last token (V after it is 0)
    d2 = 1.0 + gamma * 0.0 - 0.3  # 0.7
    a2 = d2
    d1 = -0.2 + gamma * 0.3 - 0.4  # -0.33
    a1 = d1 + gamma * lam * a2  # 0.174
    d0 = 0.1 + gamma * 0.4 - 0.5  # -0.04
    a0 = d0 + gamma * lam * a1  # 0.08528
    # row 1: the padded reward 9.0 and value 7.0 must not leak in
    e1 = 2.0 + gamma * 0.0 - 0.6  # 1.4
    b1 = e1
    e0 = 0.0 + gamma * 0.6 - 0.2  # 0.34
    b0 = e0 + gamma * lam * b1  # 1.348
    rows_approx(advantages, [[a0, a1, a2], [b0, b1, 0.0]])
    rows_approx(returns, [[a0 + 0.5, a1 + 0.4, a2 + 0.3], [b0 + 0.2, b1 + 0.6, 0.0]])


def test_gae_skips_env_tokens_inside_an_episode():
    """Two turns with an env token between them: the env token gets no advantage, and the first
    turn's last token bootstraps from the second turn's first token (not from the env token)."""
    gamma, lam = 0.9, 0.8
    mask = torch.tensor([[True, True, False, True, False]])  # sampled, sampled, env, sampled, pad
    rewards = t([[0.0, 0.5, 7.0, 1.0, 3.0]])
    values = t([[0.2, 0.3, 9.0, 0.6, 5.0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
    a3 = 1.0 + gamma * 0.0 - 0.6
    a1 = (0.5 + gamma * 0.6 - 0.3) + gamma * lam * a3
    a0 = (0.0 + gamma * 0.3 - 0.2) + gamma * lam * a1
    rows_approx(advantages, [[a0, a1, 0.0, a3, 0.0]])
    rows_approx(returns, [[a0 + 0.2, a1 + 0.3, 0.0, a3 + 0.6, 0.0]])


def test_gae_on_right_padded_rows_is_unchanged_bit_for_bit():
    """The skipping loop gives exactly the plain recursion's floats on single-turn rows."""
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen)
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    expected = torch.zeros(6, 9)
    for b in range(6):
        nxt_v, nxt_a = torch.tensor(0.0), torch.tensor(0.0)
        for i in reversed(range(int(lengths[b]))):
            delta = rewards[b, i] + 0.99 * nxt_v - values[b, i]
            nxt_a = delta + 0.99 * 0.95 * nxt_a
            expected[b, i], nxt_v = nxt_a, values[b, i]
    assert torch.equal(advantages, expected)


# --- whitening -------------------------------------------------------------------------


def test_whiten_masked_entries():
    x = t([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    out = whiten(x, m)
    # masked entries 1, 2, 3, 4: mean 2.5, Bessel variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    sd = math.sqrt(5 / 3 + 1e-8)
    rows_approx(out, [[-1.5 / sd, -0.5 / sd, 0.5 / sd], [1.5 / sd, 0.0, 0.0]])
    vals = out[m]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(vals.var()) == pytest.approx(1.0, abs=1e-6)  # torch's var is Bessel-corrected too

    kept = whiten(x, m, shift_mean=False)
    rows_approx(kept, [[2.5 - 1.5 / sd, 2.5 - 0.5 / sd, 2.5 + 0.5 / sd], [2.5 + 1.5 / sd, 0.0, 0.0]])


# --- ppo_loss ---------------------------------------------------------------------------

# Three real tokens and one padded one, clip_ratio = 0.2, clip_value = 0.2:
#   token a: r = 1.5, A = +1   -> clipped above: −1.2
#            v = 1.0, v_old = 0.5, R = 1.2 -> (v−R)² = 0.04, clipped v 0.7: 0.25 -> 0.5·0.25 (value clip active)
#   token b: r = 0.5, A = −1   -> clipped below: −min(−0.5, −0.8) = 0.8
#            v = 0.3, v_old = 0.4, R = 0.0 -> both 0.09 -> 0.5·0.09 (not clipped)
#   token c: r = 1.1, A = +2   -> inside: −2.2
#            v = 2.0, v_old = 1.0, R = 3.0 -> 1.0 vs clipped v 1.2: 3.24 -> 0.5·3.24 (value clip active)
RATIO = [[1.5, 0.5], [1.1, 1.0]]
OLD_LOGPS = [[-1.0, -2.0], [-0.7, -3.0]]
ADVANTAGES = [[1.0, -1.0], [2.0, 5.0]]
VALUES = [[1.0, 0.3], [2.0, 8.0]]
OLD_VALUES = [[0.5, 0.4], [1.0, -8.0]]
RETURNS = [[1.2, 0.0], [3.0, 4.0]]
PPO_MASK = torch.tensor([[True, True], [True, False]])


def ppo_inputs(requires_grad: bool = False):
    logps = [
        [o + math.log(r) for o, r in zip(orow, rrow, strict=True)]
        for orow, rrow in zip(OLD_LOGPS, RATIO, strict=True)
    ]
    logps[1][1] = 4.0  # garbage at the padded position
    return (
        t(logps, requires_grad),
        t(OLD_LOGPS),
        t(ADVANTAGES),
        t(VALUES, requires_grad),
        t(OLD_VALUES),
        t(RETURNS),
        PPO_MASK,
    )


def test_ppo_loss_hand_value_with_both_clips():
    loss, metrics = ppo_loss(*ppo_inputs(), clip_ratio=0.2, clip_value=0.2, vf_coef=0.5, normalizer=3.0)
    policy = -1.2 + 0.8 - 2.2
    value = 0.5 * 0.25 + 0.5 * 0.09 + 0.5 * 3.24
    assert metrics["policy_loss_sum"] == pytest.approx(policy, rel=1e-5)
    assert metrics["value_loss_sum"] == pytest.approx(value, rel=1e-5)
    assert metrics["loss_sum"] == pytest.approx(policy + 0.5 * value, rel=1e-5)
    assert loss.item() == pytest.approx((policy + 0.5 * value) / 3, rel=1e-5)
    assert metrics["clipped_tokens"] == 2.0
    assert metrics["value_clipped_tokens"] == 2.0
    assert metrics["num_tokens"] == 3.0
    assert metrics["ratio_sum"] == pytest.approx(1.5 + 0.5 + 1.1, rel=1e-5)
    kl = sum((r - 1) - math.log(r) for r in (1.5, 0.5, 1.1))
    assert metrics["approx_kl_sum"] == pytest.approx(kl, rel=1e-4)


def test_ppo_loss_gradients_vanish_where_clipped():
    logps, old, adv, values, old_values, returns, mask = ppo_inputs(requires_grad=True)
    loss, _ = ppo_loss(
        logps,
        old,
        adv,
        values,
        old_values,
        returns,
        mask,
        clip_ratio=0.2,
        clip_value=0.2,
        vf_coef=0.5,
        normalizer=3.0,
    )
    loss.backward()
    # policy: only token c is unclipped, d(−r·A)/d logp = −1.1·2 / 3
    rows_approx(logps.grad, [[0.0, 0.0], [-2.2 / 3, 0.0]])
    # value: a and c take the clipped branch (no gradient to v); b: vf_coef · (v − R) / 3 = 0.5 · 0.3 / 3
    rows_approx(values.grad, [[0.0, 0.5 * 0.3 / 3], [0.0, 0.0]])


def test_ppo_on_policy_ratio_is_exactly_one():
    logps = t([[-0.3, -2.7, -1.1], [-0.9, -0.4, -5.0]])
    zeros = torch.zeros(2, 3)
    _, metrics = ppo_loss(
        logps, logps.clone(), t([[1.0, -1.0, 0.5], [2.0, -3.0, 0.0]]), zeros, zeros, zeros, MASK,
        clip_ratio=0.0, clip_value=0.2, vf_coef=0.1, normalizer=5.0,
    )  # fmt: skip
    assert metrics["ratio_sum"] == metrics["num_tokens"] == 5.0
    assert metrics["clipped_tokens"] == 0.0
    assert metrics["approx_kl_sum"] == 0.0
