"""Bin packing: capacity respected, every sample/token exactly once, deterministic."""

from __future__ import annotations

import random

import pytest

from rollout.data.packing import Segment, pack_bfd, pack_wrapped


def random_lengths(n: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_bfd_capacity_and_each_sample_once(seed):
    lengths = random_lengths(300, 64, seed)
    bins = pack_bfd(lengths, 64)
    assert all(sum(s.length for s in b) <= 64 for b in bins)
    placed = sorted(s.sample for b in bins for s in b)
    assert placed == list(range(len(lengths)))
    assert all(s.start == 0 and s.end == lengths[s.sample] for b in bins for s in b)
    # BFD's worst case is 11/9 OPT + 6/9 bins; the volume bound is <= OPT
    lower_bound = -(-sum(lengths) // 64)
    assert len(bins) <= 11 / 9 * lower_bound + 1
    assert pack_bfd(lengths, 64) == bins


def test_bfd_best_fit_and_ties():
    # sorted: 6 (idx1), 5 (idx0), 5 (idx3), 4 (idx2), 3 (idx4), 1 (idx5)
    lengths = [5, 6, 4, 5, 3, 1]
    bins = pack_bfd(lengths, 10)
    assert bins == [
        [Segment(1, 0, 6), Segment(2, 0, 4)],  # 4 fits best in bin 0 (4 left) rather than bin 1 (5 left)
        [Segment(0, 0, 5), Segment(3, 0, 5)],
        [Segment(4, 0, 3), Segment(5, 0, 1)],
    ]
    # equally full bins: the first one opened wins
    assert pack_bfd([3, 3, 2], 5) == [[Segment(0, 0, 3), Segment(2, 0, 2)], [Segment(1, 0, 3)]]


def test_bfd_rejects_bad_lengths():
    with pytest.raises(ValueError, match="outside"):
        pack_bfd([3, 11], 10)
    with pytest.raises(ValueError, match="outside"):
        pack_bfd([0], 10)
    with pytest.raises(ValueError, match="capacity"):
        pack_bfd([1], 0)
    assert pack_bfd([], 10) == []


@pytest.mark.parametrize("seed", range(5))
def test_wrapped_covers_every_token_once_in_order(seed):
    lengths = random_lengths(200, 50, seed)
    rows = pack_wrapped(lengths, 32)
    assert all(sum(s.length for s in r) == 32 for r in rows[:-1])
    assert 0 < sum(s.length for s in rows[-1]) <= 32
    flat = [(s.sample, t) for r in rows for s in r for t in range(s.start, s.end)]
    assert flat == [(i, t) for i, n in enumerate(lengths) for t in range(n)]
    assert pack_wrapped(lengths, 32) == rows


def test_wrapped_cuts_and_continues():
    assert pack_wrapped([3, 6, 0, 2], 4) == [
        [Segment(0, 0, 3), Segment(1, 0, 1)],
        [Segment(1, 1, 5)],
        [Segment(1, 5, 6), Segment(3, 0, 2)],
    ]
    assert pack_wrapped([8], 4) == [[Segment(0, 0, 4)], [Segment(0, 4, 8)]]
    assert pack_wrapped([], 4) == []
