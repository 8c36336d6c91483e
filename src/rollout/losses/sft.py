"""Supervised fine-tuning loss: token-level cross-entropy.

The loss is a *sum* over target tokens divided by an explicit `normalizer`
(the number of target tokens in the whole optimizer step), so gradient
accumulation over micro-batches gives exactly the gradient of one big batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions predict a target, and the target ids.

    Position t predicts token t+1 when token t+1 is a loss token *and* it
    continues the same packed segment (its position id is t's plus one), so
    packed samples never learn from each other's tokens.
    Returns `valid` [B, T-1] bool and `targets` [B, T-1] long.
    """
    valid = loss_mask[:, 1:] & (position_ids[:, 1:] == position_ids[:, :-1] + 1)
    return valid, input_ids[:, 1:]


def sft_loss(
    logits: torch.Tensor, targets: torch.Tensor, *, normalizer: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy summed over `logits` [N, V] vs `targets` [N], divided by `normalizer`.

    Metrics: `loss_sum` (nats, for exact aggregation across micro-batches) and
    `num_targets`.
    """
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    token_losses = F.cross_entropy(logits.float(), targets, reduction="none")
    loss_sum = token_losses.sum()
    return loss_sum / normalizer, {
        "loss_sum": float(loss_sum.detach()),
        "num_targets": float(targets.numel()),
    }
