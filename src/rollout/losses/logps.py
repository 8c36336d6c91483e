"""Summed log-probabilities of completion tokens, for DPO / KTO and their references.

    logps, counts = sequence_logps(model, batch)              # batch: a (unpacked) TokenBatch
    logps, counts = completion_logps(logits, input_ids, loss_mask)
    avg = average_logps(logps, counts)                        # what IPO expects (see preference.py)

Both return `logps` [B] float32, the sum over the target tokens t of a row
(`loss_mask[:, t]`, t >= 1) of `log p(input_ids[:, t] | input_ids[:, <t])`, and
`counts` [B] long, the number of such tokens. `loss_mask[:, 0]` is ignored: the
first token has nothing to be predicted from.

Memory: a full `log_softmax` over [B, T, V] costs another [B, T, V] float32
tensor (Qwen's V = 152k: 0.6 GB per 1k tokens). We score only the target
positions (`target_logps`: the picked entries of a float32 log_softmax, whose
[N, V] output is dropped at once; the backward rebuilds the softmax), so the
only large tensor kept is one float32 copy of the [N, V] target rows. With
`gather_lm_head=True` (default) `sequence_logps` goes further and projects only
the N target positions through the LM head, so the [B, T, V] logits are never
built at all -- the same trick as TRL's fused LM head (trl.trainer.utils.add_fused_lm_head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from rollout.data.collate import TokenBatch

# Config attributes of models whose logits are NOT plain `lm_head(hidden)` (Gemma's
# soft-capping, Cohere's `logit_scale`, Granite's `logits_scaling`, ...). For those we
# let the model's own forward build the logits instead of calling the head ourselves.
_LOGIT_TRANSFORM_ATTRS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def completion_logps(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of target-token log-probs per row, and the number of targets.

    logits [B, T, V] (any float dtype), input_ids [B, T] long, loss_mask [B, T] bool.
    `logits[:, t - 1]` predicts `input_ids[:, t]` for every t >= 1 with `loss_mask[:, t]`.
    Returns (logps [B] float32, counts [B] long); differentiable w.r.t. `logits`.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2] or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"expected logits [B, T, V], input_ids and loss_mask [B, T]; got {tuple(logits.shape)}, "
            f"{tuple(input_ids.shape)}, {tuple(loss_mask.shape)}"
        )
    valid = loss_mask[:, 1:].bool()
    rows = valid.nonzero(as_tuple=True)[0]
    per_token = target_logps(logits[:, :-1][valid], input_ids[:, 1:][valid])
    return _sum_rows(per_token, rows, logits.shape[0]), valid.sum(dim=1)


def target_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[n, targets[n]] for logits [N, V], targets [N], in float32. [N]

    One float32 copy of `logits` (none when it is float32 already) is kept for the backward, no
    [N, V] log_softmax output: the forward takes the picked entries of torch's fused
    `log_softmax` and drops the rest; the backward rebuilds softmax(logits) (`_TargetLogps`).
    """
    return _TargetLogps.apply(logits.float(), targets)


class _TargetLogps(torch.autograd.Function):
    """`log_softmax(logits).gather(targets)` with only `logits` saved for the backward
    (d/dlogits = grad * (onehot(target) - softmax(logits))). Not `logit[target] -
    logsumexp(logits)`: on the CPU logsumexp is unfused and its `exp` takes a slow path wherever
    a logit lies more than ~87 below its row's max -- 2.3x slower forward+backward than this at
    600 x 512 on one thread, 8x on a peaked policy's rows (`benchmarks/logps_kernels.py`)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, targets: Tensor) -> Tensor:
        ctx.save_for_backward(logits, targets)
        index = targets.unsqueeze(-1)
        return torch.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        logits, targets = ctx.saved_tensors  # type: ignore[attr-defined]
        grad = grad.unsqueeze(-1)
        out = torch.softmax(logits, dim=-1).mul_(grad.neg())
        return out.scatter_add_(-1, targets.unsqueeze(-1), grad), None


def sequence_logps(
    model: nn.Module, tokens: TokenBatch, *, gather_lm_head: bool = True
) -> tuple[Tensor, Tensor]:
    """Run a transformers causal LM on `tokens` and return `completion_logps` of it.

    `model` is a `*ForCausalLM` or a peft model wrapping one (LoRA layers are
    injected into the wrapped model's modules, so its decoder and head carry them;
    for an adapter-disabled reference run this under `model.disable_adapter()`).
    Prompt-learning adapters (prefix/prompt tuning: virtual tokens) are not supported.
    Rows are scored independently: packed batches (a 4D attention mask) are refused.

    With `gather_lm_head`, the decoder runs alone and the LM head is applied to the
    hidden states of the positions that predict a loss token only. We fall back to
    the full logits when the model has no separate decoder/head
    (`get_decoder()` / `get_output_embeddings()`) or transforms its logits
    (soft-capping, logit scales): then `lm_head(hidden)` would not be its logits.
    """
    if tokens.is_packed:
        raise ValueError("sequence_logps scores one sequence per row; packed batches are not supported")
    parts = decoder_and_head(model) if gather_lm_head else None
    if parts is None:
        logits = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                       position_ids=tokens.position_ids, use_cache=False).logits
        return completion_logps(logits, tokens.input_ids, tokens.loss_mask)

    from rollout.models.cpu_matmul import project
    from rollout.models.lean_decoder import decoder_hidden_states

    decoder, head = parts
    hidden = decoder_hidden_states(unwrap_peft(model), decoder, tokens.input_ids, tokens.attention_mask,
                                   tokens.position_ids)  # [B, T, H]
    valid = tokens.loss_mask[:, 1:].bool()
    rows = valid.nonzero(as_tuple=True)[0]
    logits = project(head, hidden[:, :-1][valid])  # [N, V]: only the positions that predict a target
    per_token = target_logps(logits, tokens.input_ids[:, 1:][valid])
    return _sum_rows(per_token, rows, hidden.shape[0]), valid.sum(dim=1)


def average_logps(logps: Tensor, counts: Tensor) -> Tensor:
    """Length-averaged log-probs `logps / counts` (a row without targets gives 0). [B]

    IPO is defined on these (see `rollout.losses.preference.dpo_loss`).
    """
    return logps / counts.clamp(min=1).to(logps.dtype)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (itself when not wrapped)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


# --- helpers ----------------------------------------------------------------------


def _sum_rows(per_token: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    """Sum `per_token` [N] into `num_rows` buckets given each token's row index [N]."""
    return per_token.new_zeros(num_rows).index_add(0, rows, per_token)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, lm_head) when `lm_head(decoder(...).last_hidden_state)` are the model's logits."""
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):  # virtual tokens live in the peft wrapper's forward
        return None
    base = unwrap_peft(model)
    get_decoder = getattr(base, "get_decoder", None)
    get_head = getattr(base, "get_output_embeddings", None)
    if not callable(get_decoder) or not callable(get_head):
        return None
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if any(getattr(config, attr, None) not in (None, 1.0) for attr in _LOGIT_TRANSFORM_ATTRS):
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is base or not isinstance(head, nn.Module):
        return None
    return decoder, head
