"""GRPO-family policy loss: group-relative advantages and a clipped token surrogate.

    advantages = compute_group_advantages(rewards, group_ids, scale_rewards="group")     # [N]
    normalizer = grpo_normalizer("token_mean", [mb.mask for mb in micro_batches], max_completion_len)
    for mb in micro_batches:
        loss, metrics = grpo_loss(mb.logps, mb.old_logps, mb.advantages, mb.mask,
                                  clip_low=0.2, clip_high=0.28, loss_agg="token_mean",
                                  normalizer=normalizer)
        loss.backward()

One function covers GRPO (Shao et al. 2024, arXiv:2402.03300), DAPO's decoupled clip and
token-level aggregation (Yu et al. 2025, arXiv:2503.14476), Dr. GRPO (Liu et al. 2025,
arXiv:2503.20783) and GSPO (Zheng et al. 2025, arXiv:2507.18071). As everywhere in
`rollout.losses`, the loss is a SUM divided by an explicit `normalizer` computed once for the
whole optimizer step (`grpo_normalizer`), so gradient accumulation over micro-batches gives
exactly the gradient of the full batch; metrics are sums and counts that aggregate by
summation (except `ratio_max`: take the max). Under data parallelism the normalizer must
count the tokens / sequences of every rank (all-reduce the sum), and each rank's loss is then
summed, not averaged, across ranks (i.e. multiply by the world size if the backend averages).

TRL 1.16 (`GRPOTrainer._compute_loss`) correspondence and differences:
- loss_agg "token_mean" is TRL's "dapo" (its default); "seq_mean" is TRL's "grpo"; "dr_grpo"
  is TRL's "dr_grpo". TRL's "grpo"/"dr_grpo"/"bnpo" normalise per micro-batch and divide by
  the accumulation steps, which equals ours only when every micro-batch has the same number
  of sequences (and, for "bnpo", tokens); ours is exact in all cases.
- Reward std: TRL uses Bessel-corrected std (`trl.trainer.utils.nanstd`) plus 1e-4; so do we.
- TRL's default `use_bias_correction_kl=True` multiplies the k3 term by the (differentiable)
  policy ratio (DeepSeek-V3.2); we use the plain k3 term, i.e. TRL with that flag False.
- TRL's default `vllm_importance_sampling_mode` is "sequence_mask"; our correction is its
  "token_truncate" mode with `clip_min=None`, `clip_max=tis_cap`. Like TRL, the weight
  multiplies only the policy surrogate, not the KL term (verl does the same).
- TRL counts clipping per sequence when `importance_sampling_level="sequence"`; we always
  count tokens (a sequence-level clip marks all of that sequence's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from rollout.losses.metrics import read_back

RewardScale = Literal["group", "batch", "none"]
LossAgg = Literal["token_mean", "seq_mean", "dr_grpo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
REWARD_SCALES: tuple[str, ...] = ("group", "batch", "none")
LOSS_AGGS: tuple[str, ...] = ("token_mean", "seq_mean", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
GRPO_METRICS: tuple[str, ...] = ("loss_sum", "num_tokens", "num_seqs", "clipped_tokens", "ratio_sum", "ratio_max",
                                 "kl_sum", "is_weight_sum", "is_capped_tokens")  # what `grpo_loss` returns


def compute_group_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_rewards: RewardScale, eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages A_i = (r_i − mean_g(i)) / scale, for `rewards` [N] float.

    `group_ids` [N] long says which prompt each completion answers; ids need not be
    contiguous or sorted, and groups may have different sizes (e.g. after filtering).
    - "group": scale = std of i's group + eps (GRPO, Shao et al. 2024, arXiv:2402.03300).
    - "batch": scale = std of all N rewards + eps, the mean still per group (Liu et al. 2025,
      "Part I: Tricks or Traps?", arXiv:2508.08221; TRL's `scale_rewards="batch"`).
    - "none": no scaling (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783), which removes the
      question-difficulty bias of dividing by the group std.
    The std is Bessel-corrected (unbiased, divides by n − 1), as TRL 1.16's `nanstd`. A group
    of one, or of equal rewards, gets advantage 0 (TRL: NaN std, then `nan_to_num` → 0).
    Returns [N] float32.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(REWARD_SCALES)}, got {scale_rewards!r}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    r = rewards.float()
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    means = torch.zeros(counts.numel(), dtype=r.dtype, device=r.device).index_add_(0, group, r) / counts
    centered = r - means[group]
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        sq_sums = torch.zeros_like(means).index_add_(0, group, centered**2)
        std = (sq_sums / (counts - 1).clamp(min=1)).sqrt()[group]  # a group of one: centered is 0
    else:
        std = r.std() if r.numel() > 1 else torch.zeros((), device=r.device)
    return centered / (std + eps)


def compute_importance_ratio(
    logps: Tensor, old_logps: Tensor, mask: Tensor, *, level: ImportanceSamplingLevel
) -> Tensor:
    """Policy ratio [B, T] of `logps` to `old_logps` (both [B, T]); 1 exactly at unmasked positions.

    - "token": r_t = exp(logp_t − old_t).
    - "sequence" (GSPO, Zheng et al. 2025, arXiv:2507.18071): s = exp(mean over the row's
      masked tokens of (logp − old)), the length-normalised sequence ratio, broadcast as
      GSPO-token's s_t = sg[s] · π(y_t) / sg[π(y_t)]: its value is s at every token and
      d s_t / d logp_t = s. With one advantage per sequence this has exactly the value and
      gradient of TRL's `importance_sampling_level="sequence"` (a [B, 1] ratio whose
      gradient is s/|y| per token, summed over the |y| tokens of its sequence) under every
      aggregation.
    When logps == old_logps every entry is exactly 1.0 (exp(0)), at both levels.
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, got {level!r}"
        )
    # Zero the padding first: garbage (or -inf) log-probs there must not reach exp or its gradient.
    log_ratio = torch.where(mask, logps.float() - old_logps.float(), 0.0)
    if level == "token":
        return torch.exp(log_ratio)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    logps_masked = torch.where(mask, logps.float(), 0.0)
    ratio = torch.exp(seq_log_ratio.detach()) * torch.exp(logps_masked - logps_masked.detach())
    return torch.where(mask, ratio, 1.0)


def grpo_loss_terms(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    loss_agg: LossAgg,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    rollout_logps: Tensor | None = None,
    tis_cap: float | None = None,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Clipped GRPO surrogate on B completions: `logps`, `old_logps`, `mask` [B, T]; `advantages` [B].

    Per masked token, with r the importance ratio (`compute_importance_ratio`):

        ℓ_t = w_t · −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A) + beta · k3_t

    - decoupled clip range (DAPO, Yu et al. 2025, arXiv:2503.14476: clip_high > clip_low
      leaves room for low-probability tokens to rise). GSPO uses much smaller ranges (~3e-4/4e-4).
    - k3_t = exp(ref − logp) − (ref − logp) − 1, the non-negative unbiased KL(π‖ref)
      estimator (Schulman 2020, http://joschu.net/blog/kl-approx.html), as in GRPO. Only
      when beta > 0 (ref_logps required); with beta = 0 and ref_logps given it is still
      reported in `kl_sum`.
    - w_t = min(exp(old − rollout), tis_cap), detached: truncated importance sampling for the
      sampler/trainer mismatch (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training"), when `rollout_logps` (the engine's log-probs) is given.
      It weights the policy term only, as TRL and verl do. 1 when rollout_logps is None.

    `loss_agg` picks the numerator; the caller gets the denominator from `grpo_normalizer`:
    "token_mean": Σ over masked tokens (normalizer: masked tokens in the step);
    "seq_mean": Σ over sequences of their mean token loss (normalizer: sequences in the step);
    "dr_grpo": Σ over masked tokens (normalizer: sequences × max completion length).

    Returns `(agg_sum / normalizer, metrics)`; metrics (0-dim tensors, or 0.0 where there is no
    term; floats through `grpo_loss`; summed over micro-batches):
    `loss_sum` (agg_sum), `num_tokens`, `num_seqs` (rows with ≥ 1 masked token),
    `clipped_tokens` (tokens whose clipped branch is active: r > 1 + clip_high with A > 0 or
    r < 1 − clip_low with A < 0, TRL's `clip_ratio/region`), `ratio_sum`, `ratio_max`
    (aggregate with MAX; 0 if no tokens), `kl_sum` (Σ k3; 0 without ref_logps),
    `is_weight_sum` (Σ w), `is_capped_tokens` (tokens with w truncated at tis_cap).
    """
    _check_grpo_args(logps, old_logps, advantages, mask, ref_logps, rollout_logps, clip_low, clip_high)
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    if rollout_logps is not None and (tis_cap is None or tis_cap <= 0):
        raise ValueError(f"rollout_logps needs tis_cap > 0, got {tis_cap}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {loss_agg!r}")

    ratio = compute_importance_ratio(logps, old_logps, mask, level=importance_sampling_level)
    adv = advantages.float().unsqueeze(-1)  # [B, 1]
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    token_loss = -torch.min(ratio * adv, clipped_ratio * adv)

    if rollout_logps is not None:
        assert tis_cap is not None  # checked above
        with torch.no_grad():
            is_weight = torch.exp(torch.where(mask, old_logps.float() - rollout_logps.float(), 0.0))
            is_capped = mask & (is_weight > tis_cap)
            is_weight = is_weight.clamp(max=tis_cap)
        token_loss = token_loss * is_weight
    else:
        is_weight, is_capped = torch.ones_like(ratio), torch.zeros_like(mask)

    kl = None
    if ref_logps is not None:
        log_ref_ratio = torch.where(mask, ref_logps.float() - logps.float(), 0.0)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if beta > 0:
            token_loss = token_loss + beta * kl

    token_loss = torch.where(mask, token_loss, 0.0)
    if loss_agg == "seq_mean":
        agg_sum = (token_loss.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:  # token_mean and dr_grpo share the numerator; they differ in the normalizer
        agg_sum = token_loss.sum()

    with torch.no_grad():  # 0-dim tensors, no boolean indexing: nothing here waits for the device
        clipped = mask & (((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0)))
        masked_max = torch.where(mask, ratio, float("-inf")).max() if ratio.numel() else ratio.new_zeros(())
        metrics: dict[str, Tensor | float] = {
            "loss_sum": agg_sum.detach(),
            "num_tokens": mask.sum(),
            "num_seqs": mask.any(-1).sum(),
            "clipped_tokens": clipped.sum(),
            "ratio_sum": torch.where(mask, ratio, 0.0).sum(),
            "ratio_max": torch.where(mask.any(), masked_max, 0.0),
            "kl_sum": torch.where(mask, kl, 0.0).sum() if kl is not None else 0.0,
            "is_weight_sum": torch.where(mask, is_weight, 0.0).sum(),
            "is_capped_tokens": is_capped.sum(),
        }
    return agg_sum / normalizer, metrics


grpo_loss = read_back(grpo_loss_terms)
"""`grpo_loss_terms` with its metrics read back as floats, in one transfer. A training loop's loss
function returns `grpo_loss_terms`' tensors instead, which the backend reads after queuing the
backward (`rollout.losses.metrics`)."""


def grpo_normalizer(loss_agg: LossAgg, masks: Sequence[Tensor], max_completion_len: int) -> float:
    """The denominator of `grpo_loss` for one optimizer step, from its micro-batches' [B, T] masks.

    "token_mean": masked tokens; "seq_mean": sequences; "dr_grpo": sequences ×
    `max_completion_len` (Liu et al. 2025: a constant per sequence, so no length bias).
    A sequence is a row with at least one masked token (all rows, in TRL, whose completions
    always hold ≥ 1 token). Local to this process: all-reduce (sum) it under data parallelism.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {loss_agg!r}")
    if not masks:
        raise ValueError("grpo_normalizer needs at least one micro-batch mask")
    if loss_agg == "token_mean":
        total = sum(int(m.sum()) for m in masks)
    else:
        total = sum(int(m.any(-1).sum()) for m in masks)
    if loss_agg == "dr_grpo":
        if max_completion_len <= 0:
            raise ValueError(f"max_completion_len must be > 0, got {max_completion_len}")
        longest = max(int(m.sum(-1).max()) if m.numel() else 0 for m in masks)
        if longest > max_completion_len:
            raise ValueError(
                f"a completion has {longest} tokens, more than max_completion_len={max_completion_len}"
            )
        total *= max_completion_len
    if total <= 0:
        raise ValueError(f"the step's masks select no tokens, so the {loss_agg} normalizer would be 0")
    return float(total)


def _check_grpo_args(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logps: Tensor | None,
    rollout_logps: Tensor | None,
    clip_low: float,
    clip_high: float,
) -> None:
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got {tuple(logps.shape)}")
    for name, t in (
        ("old_logps", old_logps),
        ("mask", mask),
        ("ref_logps", ref_logps),
        ("rollout_logps", rollout_logps),
    ):
        if t is not None and t.shape != logps.shape:
            raise ValueError(f"{name} must have logps' shape {tuple(logps.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logps.shape[0]}], got {tuple(advantages.shape)}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
