"""Micro-batch tensors: padding, packed positions and block-diagonal masks, loss counts."""

from __future__ import annotations

import pytest
import torch

from rollout.data.collate import (
    attention_mask_for,
    collate_packed,
    collate_padded,
    collate_pairs,
    to_additive_mask,
)
from rollout.data.packing import Segment, pack_bfd, pack_wrapped
from rollout.data.tokenize import TokenizedPair, TokenizedSample
from rollout.errors import ModelError

PAD = 0


def sample(ids: list[int], mask: list[int]) -> TokenizedSample:
    return TokenizedSample(input_ids=tuple(ids), loss_mask=tuple(bool(m) for m in mask))


SAMPLES = [
    sample([11, 12, 13], [0, 1, 1]),
    sample([21, 22, 23, 24, 25], [0, 0, 1, 1, 1]),
    sample([31, 32], [0, 1]),
]


def test_collate_padded():
    batch = collate_padded(SAMPLES, PAD)
    assert batch.input_ids.tolist() == [[11, 12, 13, 0, 0], [21, 22, 23, 24, 25], [31, 32, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [
        [False, True, True, False, False],
        [False, False, True, True, True],
        [False, True, False, False, False],
    ]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.attention_mask.dtype == torch.long
    assert batch.position_ids.tolist() == [list(range(5))] * 3
    assert batch.sample_index.tolist() == [[0, 0, 0, -1, -1], [1, 1, 1, 1, 1], [2, 2, -1, -1, -1]]
    assert batch.num_tokens == 10
    assert batch.num_loss_tokens == 6
    assert not batch.is_packed
    assert attention_mask_for(batch, attn_implementation="eager", dtype=torch.float32) is batch.attention_mask


def test_collate_packed_positions_masks_and_counts():
    rows = [[Segment(0, 0, 3), Segment(2, 0, 2)], [Segment(1, 0, 5)]]
    batch = collate_packed(rows, SAMPLES, PAD, pad_to=6)
    assert batch.input_ids.tolist() == [[11, 12, 13, 31, 32, 0], [21, 22, 23, 24, 25, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]
    assert batch.sample_index.tolist() == [[0, 0, 0, 2, 2, -1], [1, 1, 1, 1, 1, -1]]
    assert batch.loss_mask.tolist() == [
        [False, True, True, False, True, False],
        [False, False, True, True, True, False],
    ]
    assert batch.num_tokens == 10 and batch.num_loss_tokens == 6
    assert batch.is_packed
    mask = batch.attention_mask
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    expected_row0 = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],  # sample 2 never sees sample 0
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # the pad attends to itself only
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected_row0)
    assert torch.equal(mask[1, 0, :5, :5], torch.ones(5, 5, dtype=torch.bool).tril())
    assert mask[1, 0, 5].tolist() == [False] * 5 + [True]
    assert mask.any(dim=-1).all()  # no all-False attention row (SDPA would give NaN)


def test_packed_mask_is_block_diagonal_for_random_packs():
    samples = [sample(list(range(1, n + 1)), [0] + [1] * (n - 1)) for n in (7, 3, 9, 1, 4, 8, 2, 5)]
    lengths = [len(s.input_ids) for s in samples]
    for rows in (pack_bfd(lengths, 12), pack_wrapped(lengths, 12)):
        batch = collate_packed(rows, samples, PAD)
        seg_of = torch.full(batch.input_ids.shape, -1)
        for b, row in enumerate(rows):
            t = 0
            for k, s in enumerate(row):
                seg_of[b, t : t + s.length] = k
                assert batch.position_ids[b, t : t + s.length].tolist() == list(range(s.length))
                t += s.length
        same = seg_of[:, :, None] == seg_of[:, None, :]
        causal = torch.ones(batch.input_ids.shape[1], batch.input_ids.shape[1], dtype=torch.bool).tril()
        real = (seg_of >= 0)[:, :, None] & (seg_of >= 0)[:, None, :]
        eye = torch.eye(batch.input_ids.shape[1], dtype=torch.bool)
        expected = (same & causal & real) | (eye & ~real)
        assert torch.equal(batch.attention_mask[:, 0], expected)
        shifted = batch.loss_mask[:, 1:] & (seg_of[:, 1:] == seg_of[:, :-1])
        assert batch.num_loss_tokens == int(shifted.sum()) == int(batch.loss_mask.sum())


def test_wrapped_continuation_is_not_a_target():
    samples = [sample([1, 2, 3, 4, 5, 6], [0, 1, 1, 1, 1, 1])]
    rows = pack_wrapped([6], 4)  # [0:4] then [4:6]
    batch = collate_packed(rows, samples, PAD)
    assert batch.loss_mask.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert batch.num_loss_tokens == 4  # token 5 lost its predecessor at the cut


def test_collate_pairs():
    pairs = [
        TokenizedPair(
            chosen_ids=(1, 2, 3), rejected_ids=(1, 2, 4, 5), prompt_len_chosen=2, prompt_len_rejected=2
        ),
        TokenizedPair(chosen_ids=(7, 8), rejected_ids=(7, 9), prompt_len_chosen=1, prompt_len_rejected=1),
    ]
    batch, num = collate_pairs(pairs, PAD)
    assert num == 2
    assert batch.input_ids.tolist() == [[1, 2, 3, 0], [7, 8, 0, 0], [1, 2, 4, 5], [7, 9, 0, 0]]
    assert batch.loss_mask.tolist() == [
        [False, False, True, False],
        [False, True, False, False],
        [False, False, True, True],
        [False, True, False, False],
    ]
    assert batch.sample_index.tolist() == [[0, 0, 0, -1], [1, 1, -1, -1], [0, 0, 0, 0], [1, 1, -1, -1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.num_tokens == 11 and batch.num_loss_tokens == 5


def test_attention_mask_for_packed():
    batch = collate_packed([[Segment(0, 0, 3), Segment(2, 0, 2)]], SAMPLES, PAD, pad_to=6)
    assert attention_mask_for(batch, attn_implementation="sdpa", dtype=torch.float32) is batch.attention_mask
    additive = attention_mask_for(batch, attn_implementation="eager", dtype=torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, batch.attention_mask)
    assert (additive[~batch.attention_mask] == torch.finfo(torch.bfloat16).min).all()
    assert attention_mask_for(batch, attn_implementation="flash_attention_2", dtype=torch.float16) is None
    with pytest.raises(ModelError, match="packed batches support"):
        attention_mask_for(batch, attn_implementation="weird", dtype=torch.float32)
    assert to_additive_mask(torch.tensor([True, False]), torch.float32).tolist() == [
        0.0,
        torch.finfo(torch.float32).min,
    ]


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="pad_to"):
        collate_packed([[Segment(1, 0, 5)]], SAMPLES, PAD, pad_to=4)
    with pytest.raises(ValueError, match="outside sample"):
        collate_packed([[Segment(2, 0, 3)]], SAMPLES, PAD)
    with pytest.raises(ValueError, match="empty"):
        collate_padded([], PAD)


def test_to_device_copies():
    batch = collate_padded(SAMPLES, PAD)
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.input_ids, batch.input_ids)
    assert moved.num_loss_tokens == batch.num_loss_tokens
