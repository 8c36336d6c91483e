"""PPO for language models: KL-penalised token rewards, GAE, whitening, clipped losses.

    rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, kl_coef=0.05)   # [B, T]
    advantages, returns = compute_gae(rewards, old_values, mask, gamma=1.0, lam=0.95)   # [B, T] each
    advantages = whiten(advantages, mask)
    loss, metrics = ppo_loss(logps, old_logps, advantages, values, old_values, returns, mask,
                             clip_ratio=0.2, clip_value=0.2, vf_coef=0.1, normalizer=step_tokens)

The RLHF recipe of Ziegler et al. 2019 (arXiv:1909.08593) and Ouyang et al. 2022
(arXiv:2203.02155) on top of PPO (Schulman et al. 2017, arXiv:1707.06347), in the shape of
TRL's former PPOTrainer (removed from TRL 1.16; we follow its last version). All [B, T]
tensors are over completion tokens, right-padded; `mask` [B, T] bool marks real tokens.
As everywhere in `rollout.losses`, `ppo_loss` is a token SUM divided by an explicit
`normalizer` (masked tokens in the optimizer step), so gradient accumulation is exact, and
its metrics are sums and counts.

Differences from TRL's PPOTrainer:
- TRL adds the score one position AFTER the last completion token when that position exists
  (`sequence_lengths_p1`), and trains the value head on that extra position too; we put the
  score on the last completion token and use one mask for the policy and value losses.
- TRL averages the policy and value losses separately over the micro-batch; we sum both
  over tokens and divide by the step's token count.
- TRL's `approxkl` metric is 0.5·(log r)²; ours is the k3 form (r − 1) − log r.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.losses.metrics import read_back


def kl_penalized_rewards(
    scores: Tensor, logps: Tensor, ref_logps: Tensor, mask: Tensor, *, kl_coef: float
) -> Tensor:
    """Per-token rewards [B, T]: −kl_coef·(logp − ref_logp), plus `scores` [B] at each row's last token.

    The per-token KL penalty keeps the policy near the reference (Ziegler et al. 2019,
    arXiv:1909.08593; Ouyang et al. 2022, arXiv:2203.02155); the sequence-level score from the
    reward model or verifier arrives at the last masked token. `logps`/`ref_logps` [B, T] are
    the sampling policy's and the reference's token log-probs (detached: rewards are data).
    0 at unmasked positions. Every row must have at least one masked token.
    """
    _check_same_shape(logps=logps, ref_logps=ref_logps, mask=mask)
    if scores.shape != logps.shape[:1]:
        raise ValueError(f"scores must be [B] = [{logps.shape[0]}], got {tuple(scores.shape)}")
    if not bool(mask.any(-1).all()):
        raise ValueError("every row needs at least one masked (completion) token to carry its score")
    with torch.no_grad():
        kl = torch.where(mask, logps.float() - ref_logps.float(), 0.0)
        rewards = -kl_coef * kl
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask, positions, -1).argmax(-1)  # [B], index of each row's last masked token
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, last] += scores.float()
    return rewards


def compute_gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over T tokens.

        δ_t = r_t + γ·V_{t+1} − V_t,    A_t = δ_t + γλ·A_{t+1},    R_t = A_t + V_t

    with V = 0 after a row's last masked token (the episode ends there), computed by a reverse
    loop over T. `token_rewards`, `values` [B, T] (values from the rollout, detached); `mask`
    [B, T] bool marks the tokens the policy sampled. Unmasked tokens inside a row (a
    multi-turn episode's env and tool tokens) are skipped: t+1 is the next *masked* token, so
    the last sampled token of a turn bootstraps from the first one of the next turn. Returns
    `(advantages, returns)`, [B, T] each, 0 at unmasked positions. (For right-padded masks
    the skipping never triggers: the result is the plain single-turn recursion.)
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    with torch.no_grad():
        rewards = torch.where(mask, token_rewards.float(), 0.0)
        vals = torch.where(mask, values.float(), 0.0)
        advantages = torch.zeros_like(rewards)
        next_value = torch.zeros_like(rewards[:, 0])
        next_advantage = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            advantage = delta + gamma * lam * next_advantage
            advantages[:, t] = torch.where(mask[:, t], advantage, 0.0)
            next_advantage = torch.where(mask[:, t], advantage, next_advantage)
            next_value = torch.where(mask[:, t], vals[:, t], next_value)
        returns = torch.where(mask, advantages + vals, 0.0)
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True) -> Tensor:
    """(x − mean) / sqrt(var + 1e-8) over the masked entries of `x`; 0 elsewhere. Same shape as x.

    mean and var are over all masked entries of the batch; var is Bessel-corrected, with the
    1e-8 of TRL's `masked_whiten`. `shift_mean=False` adds the mean back (only rescales), as
    for whitening rewards. Needs at least two masked entries.
    """
    if x.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be bool with x's shape {tuple(x.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    count = int(mask.sum())
    if count < 2:
        raise ValueError(f"whiten needs at least 2 masked entries, got {count}")
    xf = x.float()
    mean = torch.where(mask, xf, 0.0).sum() / count
    var = torch.where(mask, (xf - mean) ** 2, 0.0).sum() / (count - 1)
    whitened = (xf - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


def ppo_loss_terms(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float,
    clip_value: float,
    vf_coef: float,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO policy and value losses (Schulman et al. 2017, arXiv:1707.06347), all inputs [B, T].

    Per masked token, with r = exp(logp − old_logp):

        policy: −min(r·A, clip(r, 1 − ε, 1 + ε)·A),                          ε = clip_ratio
        value:  0.5 · max((v − R)², (clip(v, v_old − c, v_old + c) − R)²),    c = clip_value

    loss = Σ (policy + vf_coef·value) / normalizer (the step's masked token count). The value
    clip is the one of OpenAI's baselines / TRL. Gradients flow through `logps` and `values`.

    Metrics (0-dim tensors; floats through `ppo_loss`; summed over micro-batches): `loss_sum`, `policy_loss_sum`,
    `value_loss_sum` (without vf_coef), `clipped_tokens` (clipped policy branch active),
    `value_clipped_tokens` (clipped value loss strictly larger), `num_tokens`, `ratio_sum`,
    `approx_kl_sum` (Σ (r − 1) − log r, the k3 estimate of KL(old‖new), Schulman 2020).
    """
    _check_same_shape(
        logps=logps,
        old_logps=old_logps,
        advantages=advantages,
        values=values,
        old_values=old_values,
        returns=returns,
        mask=mask,
    )
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    if not 0 <= clip_ratio < 1:
        raise ValueError(f"clip_ratio must be in [0, 1), got {clip_ratio}")
    if clip_value < 0 or vf_coef < 0:
        raise ValueError(f"clip_value and vf_coef must be >= 0, got {clip_value} and {vf_coef}")

    # Zero the padding first: garbage there must not reach exp or the gradients.
    log_ratio = torch.where(mask, logps.float() - old_logps.float(), 0.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.float(), 0.0)
    policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv)

    v = torch.where(mask, values.float(), 0.0)
    v_old = torch.where(mask, old_values.float(), 0.0)
    ret = torch.where(mask, returns.float(), 0.0)
    v_clipped = v_old + (v - v_old).clamp(-clip_value, clip_value)
    value_unclipped, value_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
    value_loss = 0.5 * torch.max(value_unclipped, value_clipped)

    policy_sum = torch.where(mask, policy_loss, 0.0).sum()
    value_sum = torch.where(mask, value_loss, 0.0).sum()
    loss_sum = policy_sum + vf_coef * value_sum

    with torch.no_grad():  # 0-dim tensors, no boolean indexing: nothing here waits for the device
        clipped = mask & (((ratio > 1 + clip_ratio) & (adv > 0)) | ((ratio < 1 - clip_ratio) & (adv < 0)))
        metrics = {
            "loss_sum": loss_sum.detach(),
            "policy_loss_sum": policy_sum.detach(),
            "value_loss_sum": value_sum.detach(),
            "clipped_tokens": clipped.sum(),
            "value_clipped_tokens": (mask & (value_clipped > value_unclipped)).sum(),
            "num_tokens": mask.sum(),
            "ratio_sum": torch.where(mask, ratio, 0.0).sum(),
            "approx_kl_sum": torch.where(mask, (ratio - 1) - log_ratio, 0.0).sum(),
        }
    return loss_sum / normalizer, metrics


ppo_loss = read_back(ppo_loss_terms)
"""`ppo_loss_terms` with its metrics read back as floats, in one transfer (`rollout.losses.metrics`)."""


def _check_same_shape(**tensors: Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    if first.dim() != 2:
        raise ValueError(f"{first_name} must be [B, T], got {tuple(first.shape)}")
    for name, t in rest:
        if t.shape != first.shape:
            raise ValueError(
                f"{name} must have {first_name}'s shape {tuple(first.shape)}, got {tuple(t.shape)}"
            )
    mask = tensors.get("mask")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
