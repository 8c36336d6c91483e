"""Pack variable-length samples into fixed-capacity rows (pure Python, deterministic).

Two strategies, the same ones TRL calls "bfd" and "wrapped":

- `pack_bfd`: best-fit decreasing bin packing of whole samples. No sample is
  cut, so every packed sample trains exactly like it would unpacked (given a
  block-diagonal attention mask and position ids that restart per segment).
- `pack_wrapped`: concatenate the samples and cut every `capacity` tokens. No
  padding at all, but a sample cut at a row boundary loses its context across
  the cut: its continuation is a new segment that starts from scratch.

A row is a list of `Segment`s, token ranges of the input samples, in order.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Tokens `[start, end)` of sample number `sample`."""

    sample: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def pack_bfd(lengths: Sequence[int], capacity: int) -> list[list[Segment]]:
    """Best-fit decreasing: longest sample first, each into the fullest bin it still fits.

    Ties are broken deterministically: equal lengths by sample index, equally
    full bins by the bin opened first. Every length must be in `[1, capacity]`.
    Bins come out in the order they were opened; a bin's segments in the order
    they were placed.
    """
    _check_capacity(capacity)
    for i, length in enumerate(lengths):
        if not 1 <= length <= capacity:
            raise ValueError(
                f"sample {i} has length {length}, outside [1, {capacity}]: truncate before packing"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[Segment]] = []
    # (remaining capacity, bin index) of every bin, sorted: the best fit for a sample
    # is the first entry whose remaining capacity is >= its length.
    free: list[tuple[int, int]] = []
    for i in order:
        length = lengths[i]
        pos = bisect.bisect_left(free, (length, -1))
        if pos == len(free):
            bins.append([Segment(i, 0, length)])
            bisect.insort(free, (capacity - length, len(bins) - 1))
            continue
        remaining, b = free.pop(pos)
        bins[b].append(Segment(i, 0, length))
        bisect.insort(free, (remaining - length, b))
    return bins


def pack_wrapped(lengths: Sequence[int], capacity: int) -> list[list[Segment]]:
    """Concatenate the samples in the given order and cut a row every `capacity` tokens.

    A sample cut at a row boundary continues as a new segment (start > 0) at
    the beginning of the next row. Empty samples are skipped. Only the last row
    may be shorter than `capacity`.
    """
    _check_capacity(capacity)
    rows: list[list[Segment]] = []
    row: list[Segment] = []
    room = capacity
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {i} has negative length {length}")
        start = 0
        while start < length:
            take = min(room, length - start)
            row.append(Segment(i, start, start + take))
            start += take
            room -= take
            if room == 0:
                rows.append(row)
                row, room = [], capacity
    if row:
        rows.append(row)
    return rows


def _check_capacity(capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
