"""Tensors for one micro-batch: padded, packed, or preference pairs.

    batch = collate_padded(samples, pad_id)                  # one sample per row
    batch = collate_packed(rows, samples, pad_id)           # rows of Segments (see packing.py)
    batch, num_pairs = collate_pairs(pairs, pad_id)         # chosen rows, then rejected rows
    mask = attention_mask_for(batch, attn_implementation="eager", dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                   use_cache=False).logits

The shifted next-token loss is exactly
`CE(logits[:, :-1], input_ids[:, 1:])` weighted by `loss_mask[:, 1:]` and normalised by
`num_loss_tokens`: the first token of every packed segment has `loss_mask` False,
so no target is ever predicted from another segment or from padding.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rollout.data.packing import Segment
from rollout.data.tokenize import TokenizedPair, TokenizedSample
from rollout.errors import ModelError


@dataclass
class TokenBatch:
    """One micro-batch, `B` rows of `T` tokens.

    input_ids:      [B, T] long, right-padded with pad_id.
    loss_mask:      [B, T] bool, the targets (token t predicted from t - 1); False on pads
                    and on the first token of every segment.
    position_ids:   [B, T] long; 0, 1, 2, ... restarting at every packed segment.
                    Pads: continuing positions when padded, 0 when packed.
    attention_mask: padded/pairs: [B, T] long padding mask (1 = token, 0 = pad), the usual
                    transformers argument, good for every attention implementation.
                    packed: [B, 1, T, T] bool, True = query may attend key: causal within
                    a segment, never across segments; pads attend to themselves only (no
                    all-False row, which makes SDPA return NaN). transformers passes a 4D
                    mask through unchanged (masking_utils._preprocess_mask_arguments), so:
                    sdpa uses it as is; eager ADDS the mask to the attention scores, so a bool
                    mask would be silently wrong there -- convert it with `attention_mask_for`
                    (float additive: 0 where allowed, dtype min where not).
    sample_index:   [B, T] long: index (into the collated samples / pairs) of each token's
                    sample, -1 on pads.
    num_tokens:     non-pad tokens.
    num_loss_tokens: targets with a predecessor in their segment (= loss_mask.sum()).
    """

    input_ids: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    sample_index: Tensor
    num_tokens: int
    num_loss_tokens: int

    @property
    def is_packed(self) -> bool:
        return self.attention_mask.dim() == 4

    def to(self, device: torch.device | str) -> TokenBatch:
        """A copy with every tensor moved to `device`."""
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
            for f in fields(self)
        }
        return TokenBatch(**moved)


def collate_padded(samples: Sequence[TokenizedSample], pad_id: int) -> TokenBatch:
    """One sample per row, right-padded to the longest row."""
    rows = [[Segment(i, 0, len(s.input_ids))] for i, s in enumerate(samples)]
    ids, loss, seg, sample_index, _ = _fill_rows(rows, samples, pad_id, pad_to=None)
    width = ids.shape[1]
    is_token = sample_index >= 0
    position_ids = torch.arange(width, dtype=torch.long).expand(len(rows), width).clone()
    return TokenBatch(
        input_ids=ids,
        loss_mask=loss,
        position_ids=position_ids,
        attention_mask=is_token.long(),
        sample_index=sample_index,
        num_tokens=int(is_token.sum()),
        num_loss_tokens=_count_loss_tokens(loss, seg),
    )


def collate_packed(
    rows: Sequence[Sequence[Segment]],
    samples: Sequence[TokenizedSample],
    pad_id: int,
    pad_to: int | None = None,
) -> TokenBatch:
    """Packed rows (lists of Segments of `samples`), right-padded to the longest row or `pad_to`."""
    ids, loss, seg, sample_index, positions = _fill_rows(rows, samples, pad_id, pad_to)
    width = ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # seg is unique per segment and per pad position, so equality + causality gives
    # the block-diagonal mask with pads on the diagonal only.
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    is_token = sample_index >= 0
    return TokenBatch(
        input_ids=ids,
        loss_mask=loss,
        position_ids=positions,
        attention_mask=mask[:, None, :, :],
        sample_index=sample_index,
        num_tokens=int(is_token.sum()),
        num_loss_tokens=_count_loss_tokens(loss, seg),
    )


def collate_pairs(pairs: Sequence[TokenizedPair], pad_id: int) -> tuple[TokenBatch, int]:
    """Rows 0..B-1 = prompt + chosen, rows B..2B-1 = prompt + rejected; returns (batch, B).

    `loss_mask` marks the answer tokens (after the prompt); `sample_index` is the
    pair index on both rows of a pair.
    """
    num = len(pairs)
    sides = [(p.chosen_ids, p.prompt_len_chosen) for p in pairs] + [
        (p.rejected_ids, p.prompt_len_rejected) for p in pairs
    ]
    samples = [
        TokenizedSample(input_ids=ids, loss_mask=(False,) * prompt_len + (True,) * (len(ids) - prompt_len))
        for ids, prompt_len in sides
    ]
    batch = collate_padded(samples, pad_id)
    batch.sample_index = torch.where(batch.sample_index >= 0, batch.sample_index % max(num, 1), -1)
    return batch, num


def attention_mask_for(batch: TokenBatch, *, attn_implementation: str, dtype: torch.dtype) -> Tensor | None:
    """The `attention_mask=` to pass to a transformers model for this batch.

    Padded batches: the 2D mask, whatever the implementation. Packed batches:
    `sdpa` takes the 4D bool mask; `eager` gets it as a
    float additive mask in `dtype` (the model's dtype); flash-attention kernels
    take no dense mask: None, and transformers finds the segments from the
    restarting `position_ids` -- call the model with `use_cache=False` then, since
    with a KV cache transformers skips that detection and the rows attend across
    segments (the detection itself is tested with sdpa/eager; flash-attn is not
    installed here).
    """
    if not batch.is_packed:
        return batch.attention_mask
    if attn_implementation == "sdpa":
        return batch.attention_mask
    if attn_implementation == "eager":
        return to_additive_mask(batch.attention_mask, dtype)
    if attn_implementation.startswith("flash_attention"):
        return None
    raise ModelError(
        f"packed batches support attn_implementation sdpa, eager or flash_attention_*, got {attn_implementation!r}"
    )


def to_additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as an additive float mask: 0 where allowed, dtype min elsewhere."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


# --- helpers ----------------------------------------------------------------------


def _fill_rows(
    rows: Sequence[Sequence[Segment]],
    samples: Sequence[TokenizedSample],
    pad_id: int,
    pad_to: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """input_ids, loss_mask, segment ids, sample_index and per-segment positions, [B, T] each.

    Segment ids are 0, 1, 2, ... over the batch; pad position t gets -1 - t, unique in its row.
    """
    if not rows:
        raise ValueError("cannot collate an empty micro-batch")
    lengths = [sum(s.end - s.start for s in row) for row in rows]
    width = max(lengths)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest row ({width} tokens)")
        width = pad_to
    if width == 0:
        raise ValueError("cannot collate rows without tokens")
    # Flat lists, one buffer per tensor (`flat_tensor`): a padded batch of 16 short samples 121 -> 58 us.
    ids: list[int] = []
    loss: list[bool] = []
    seg: list[int] = []
    sample_index: list[int] = []
    positions: list[int] = []
    next_seg = 0
    for row, length in zip(rows, lengths, strict=True):
        for s in row:
            sample = samples[s.sample]
            if not 0 <= s.start < s.end <= len(sample.input_ids):
                raise ValueError(f"segment {s} is outside sample {s.sample} ({len(sample.input_ids)} tokens)")
            n = s.end - s.start
            ids += sample.input_ids[s.start : s.end]
            loss.append(False)  # no predecessor inside the segment
            loss += sample.loss_mask[s.start + 1 : s.end]
            seg += [next_seg] * n
            sample_index += [s.sample] * n
            positions += range(n)
            next_seg += 1
        pad = width - length
        ids += [pad_id] * pad
        loss += [False] * pad
        seg += range(-1 - length, -1 - width, -1)  # pad position t: -1 - t
        sample_index += [-1] * pad
        positions += [0] * pad
    shape = (len(rows), width)
    return (
        flat_tensor(ids, shape, torch.long),
        flat_tensor(loss, shape, torch.bool),
        flat_tensor(seg, shape, torch.long),
        flat_tensor(sample_index, shape, torch.long),
        flat_tensor(positions, shape, torch.long),
    )


_ARRAY_TYPES = {torch.long: "q", torch.bool: "B", torch.float32: "f"}


def flat_tensor(values: Sequence[int | bool | float], shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A `dtype` tensor of `shape` over one array of the flat `values` (int64, bool or float32; the
    tensor keeps the array alive): ~2x faster than `torch.tensor` over nested lists, and far faster
    than filling rows one `torch.tensor` at a time, for the small batches collated on every step."""
    if not values:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_TYPES[dtype], values), dtype=dtype).view(shape)


def _count_loss_tokens(loss_mask: Tensor, seg: Tensor) -> int:
    same_segment = seg[:, 1:] == seg[:, :-1]
    return int((loss_mask[:, 1:] & same_segment).sum())
