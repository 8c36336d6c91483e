"""Reward-model loss: Bradley–Terry on (chosen, rejected) pairs.

    L = -log σ(r_c − r_r − m)  [+ c · (r_c + r_r)²  when centering]

Bradley & Terry (1952); as used for RLHF reward models by Ouyang et al. (2022).
The optional centering term keeps rewards near zero (Eisenstein et al., 2023,
"Helping or Herding?"), with the same form TRL uses.
Like the SFT loss it is a sum divided by an explicit `normalizer` (pairs in the
optimizer step) so gradient accumulation is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    *,
    normalizer: float,
    margin: torch.Tensor | float = 0.0,
    center_coefficient: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`rewards_*` are [B] scalars for the same B pairs; `margin` is a float or [B]."""
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    rc, rr = rewards_chosen.float(), rewards_rejected.float()
    per_pair = -F.logsigmoid(rc - rr - margin)
    if center_coefficient:
        per_pair = per_pair + center_coefficient * (rc + rr) ** 2
    loss = per_pair.sum() / normalizer
    with torch.no_grad():
        metrics = {
            "loss_sum": float(per_pair.sum()),
            "num_pairs": float(rc.numel()),
            "correct": float((rc > rr).sum()),
            "reward_chosen_sum": float(rc.sum()),
            "reward_rejected_sum": float(rr.sum()),
        }
    return loss, metrics
