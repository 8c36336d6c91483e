"""Preference losses on sequence log-probs: DPO and its variants, and KTO.

    loss, metrics = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1, loss_type="sigmoid", normalizer=num_pairs)
    z0 = kto_kl_estimate(pi_mismatched, ref_mismatched)
    loss, metrics = kto_loss(pi, ref, labels, z0, beta=0.1, desirable_weight=1.0,
                             undesirable_weight=1.0, normalizer=num_examples)

Inputs are [B] tensors of per-sequence completion log-probs (`rollout.losses.logps`):
*summed* over the completion tokens for every loss but IPO, which wants them
*length-averaged* (`average_logps`; `LENGTH_AVERAGED_LOSS_TYPES` says which).
Like the SFT and RM losses, each is a sum over the batch divided by an explicit
`normalizer` (pairs, or KTO examples, in the whole optimizer step), so gradient
accumulation over micro-batches is exact; metrics are sums and counts for the same
reason (divide `*_sum` by `num_pairs` to log means).

TRL (1.16) parity, checked by tests/integration/test_dpo_trl_parity.py: TRL's DPO
loss is the mean over the batch, i.e. ours with `normalizer = B`. Differences:
TRL's "sigmoid" ignores `label_smoothing` (its cDPO term was removed), ours keeps
the conservative-DPO form; TRL's `rewards/*` metrics for IPO use summed log-probs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")
# Loss types whose log-probs must be averaged over the completion tokens, not summed.
LENGTH_AVERAGED_LOSS_TYPES = frozenset({"ipo"})


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    loss_type: DPOLossType,
    label_smoothing: float = 0.0,
    normalizer: float,
) -> tuple[Tensor, dict[str, float]]:
    """DPO-family loss on B pairs, with h = (π_c − ref_c) − (π_r − ref_r), all [B] log-probs.

    - "sigmoid": DPO, Rafailov et al. 2023 (arXiv:2305.18290), −log σ(βh); with
      label smoothing ε it is conservative DPO (cDPO, Mitchell 2023,
      "A note on DPO with noisy preferences"): −(1−ε)·log σ(βh) − ε·log σ(−βh), ε ∈ [0, 0.5].
    - "ipo": IPO, Azar et al. 2023 (arXiv:2310.12036, eq. 17), (h − 1/(2β))², β = τ.
      The log-probs must be LENGTH-AVERAGED over the completion tokens
      (`rollout.losses.logps.average_logps`), as in TRL, whose comment says the IPO
      authors confirmed the paper's results use this normalisation.
    - "hinge": SLiC, Zhao et al. 2023 (arXiv:2305.10425), relu(1 − βh).
    - "robust": rDPO, Chowdhury et al. 2024 (arXiv:2403.00409), an unbiased loss
      under a label-flip rate ε ∈ [0, 0.5): (−(1−ε)·log σ(βh) + ε·log σ(−βh)) / (1 − 2ε).

    Returns `(sum of per-pair losses / normalizer, metrics)`; metrics (floats):
    `loss_sum`, `num_pairs`, `reward_chosen_sum` (Σ β(π_c − ref_c)),
    `reward_rejected_sum`, `margin_sum` (Σ of their difference) and `correct`
    (pairs whose chosen reward is strictly higher).
    """
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    _check_label_smoothing(loss_type, label_smoothing)
    chosen_logratios = policy_chosen.float() - ref_chosen.float()
    rejected_logratios = policy_rejected.float() - ref_rejected.float()
    h = chosen_logratios - rejected_logratios
    eps = label_smoothing

    if loss_type == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        per_pair = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * h)
    else:  # robust
        per_pair = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)

    loss_sum = per_pair.sum()
    with torch.no_grad():
        reward_chosen = beta * chosen_logratios
        reward_rejected = beta * rejected_logratios
        metrics = {
            "loss_sum": float(loss_sum),
            "num_pairs": float(h.numel()),
            "reward_chosen_sum": float(reward_chosen.sum()),
            "reward_rejected_sum": float(reward_rejected.sum()),
            "margin_sum": float((reward_chosen - reward_rejected).sum()),
            "correct": float((reward_chosen > reward_rejected).sum()),
        }
    return loss_sum / normalizer, metrics


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl_estimate: Tensor,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    normalizer: float,
) -> tuple[Tensor, dict[str, float]]:
    """KTO, Ethayarajh et al. 2024 (arXiv:2402.01306, eq. 7), on B unpaired completions.

    With r = π − ref (summed completion log-probs, [B]) and the reference point
    z0 = max(kl_estimate, 0), detached (`kto_kl_estimate`):

        desirable   (labels True):  w_D · (1 − σ(β (r − z0)))
        undesirable (labels False): w_U · (1 − σ(β (z0 − r)))

    Returns `(sum over the B examples / normalizer, metrics)`; TRL takes the mean,
    i.e. `normalizer = B`. Metrics (floats): `loss_sum`, `num_desirable`,
    `num_undesirable`, `reward_desirable_sum` / `reward_undesirable_sum` (Σ β·r per
    class) and `kl` (z0; average it over micro-batches, do not sum).
    """
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError("desirable_weight and undesirable_weight must be >= 0")
    desirable = labels.bool()
    z0 = kl_estimate.detach().float().clamp(min=0)
    logratios = policy_logps.float() - ref_logps.float()
    per_example = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios))),
    )
    loss_sum = per_example.sum()
    with torch.no_grad():
        rewards = beta * logratios
        metrics = {
            "loss_sum": float(loss_sum),
            "num_desirable": float(desirable.sum()),
            "num_undesirable": float((~desirable).sum()),
            "reward_desirable_sum": float(rewards[desirable].sum()),
            "reward_undesirable_sum": float(rewards[~desirable].sum()),
            "kl": float(z0),
        }
    return loss_sum / normalizer, metrics


def kto_kl_estimate(policy_mismatched_logps: Tensor, ref_mismatched_logps: Tensor) -> Tensor:
    """KTO's reference point z0: mean(π − ref) over mismatched pairs, detached, clamped at 0. Scalar.

    The mismatched pairs are built as in TRL 1.16 (`KTOTrainer._prepare_dataset`):
    within each batch of n examples (in order, so sampling must be sequential) the
    completions are rotated by one, `KL_completion = [c[-1]] + c[:-1]`, i.e. prompt
    i is paired with completion (i − 1) mod n (`kl_completion_order(n)`), so the
    batch's KL estimate uses the same completions as its rewards, with other
    prompts. n must be >= 2 (with n = 1 the "mismatched" pair is the matched one).
    Under data parallelism TRL averages the per-rank estimates before clamping.
    """
    if policy_mismatched_logps.numel() == 0:
        raise ValueError("kto_kl_estimate needs at least one mismatched pair")
    diff = policy_mismatched_logps.detach().float() - ref_mismatched_logps.detach().float()
    return diff.mean().clamp(min=0)


def kl_completion_order(n: int) -> list[int]:
    """Completion index to pair with prompt i for the KL estimate: (i − 1) mod n, as TRL does."""
    if n < 2:
        raise ValueError(f"the KTO KL estimate needs at least 2 examples per batch, got {n}")
    return [n - 1, *range(n - 1)]


def _check_label_smoothing(loss_type: str, eps: float) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if loss_type == "robust" and not 0 <= eps < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for the robust loss, got {eps}")
    if loss_type == "sigmoid" and not 0 <= eps <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] for the sigmoid loss, got {eps}")
    if loss_type in ("ipo", "hinge") and eps != 0:
        raise ValueError(f"label_smoothing has no meaning for loss_type {loss_type!r}, got {eps}")
