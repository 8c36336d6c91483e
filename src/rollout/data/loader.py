"""Deterministic epoch plans and a resumable stream of micro-batches.

    plan = MicroBatchPlan(lengths, micro_batch_size=8, packing="bfd", max_seq_len=512, seed=0)
    for cursor, rows in iterate_micro_batches(plan, DataCursor(epoch=0, batch=0)):
        batch = collate_packed(rows, samples, pad_id)    # or collate_padded for packing="off"
        ...
        save cursor.to_dict() with the snapshot          # `cursor` is the NEXT micro-batch

An epoch's plan depends only on (lengths, micro_batch_size, packing,
max_seq_len, seed, epoch): its sample order comes from
`random.Random(f"{seed}:{epoch}")` (string seeds are hashed with SHA-512, so
the order is the same in every process and Python run). Resuming from a
saved cursor therefore yields exactly the micro-batches an uninterrupted run
would have seen.

- `off`:     shuffle; each row is one whole sample; `micro_batch_size` rows per micro-batch.
- `bfd`:     shuffle, best-fit-decreasing pack into rows of `max_seq_len` tokens, then
             shuffle the rows with the same epoch RNG (BFD emits long samples first).
- `wrapped`: shuffle, concatenate and cut every `max_seq_len` tokens.

With packing, `micro_batch_size` counts packed rows. `drop_last` drops an
epoch's final, incomplete micro-batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rollout.data.packing import Segment, pack_bfd, pack_wrapped
from rollout.errors import DataError

Packing = Literal["off", "bfd", "wrapped"]
PACKINGS = ("off", "bfd", "wrapped")

MicroBatch = list[list[Segment]]  # rows, each a list of segments


@dataclass(frozen=True)
class DataCursor:
    """The next micro-batch to yield: micro-batch `batch` of epoch `epoch`."""

    epoch: int = 0
    batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> DataCursor:
        return cls(epoch=_read_count(data, "epoch"), batch=_read_count(data, "batch"))


def _read_count(data: Mapping[str, object], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"invalid data cursor: {key} must be a non-negative integer, got {value!r}")
    return value


class MicroBatchPlan:
    """Which samples (or packed rows) form each micro-batch of every epoch.

    Keeps the last computed epoch (an LRU of one), so iterating or resuming
    inside an epoch costs one plan. The returned lists are that cache: read them,
    don't mutate them.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        micro_batch_size: int,
        packing: Packing,
        max_seq_len: int,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        for i, length in enumerate(lengths):
            if length < 1 or (packing != "wrapped" and length > max_seq_len):
                raise ValueError(
                    f"sample {i} has length {length}, outside [1, {max_seq_len}]: truncate first"
                )
        self.lengths: tuple[int, ...] = tuple(lengths)
        self.micro_batch_size = micro_batch_size
        self.packing: Packing = packing
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.drop_last = drop_last
        self._cache: tuple[int, list[MicroBatch]] | None = None
        if self.num_batches(0) == 0:
            raise DataError(
                f"the dataset is too small: {len(self.lengths)} samples make no full micro-batch of"
                f" {micro_batch_size} {'rows' if packing != 'off' else 'samples'}"
                f" (packing={packing}, max_seq_len={max_seq_len}, drop_last={drop_last})"
            )

    def epoch_batches(self, epoch: int) -> list[MicroBatch]:
        """The micro-batches of `epoch`: each a list of rows, each row a list of Segments."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        batches = self._plan_epoch(epoch)
        self._cache = (epoch, batches)
        return batches

    def num_batches(self, epoch: int) -> int:
        """How many micro-batches `epoch` has (constant for off/wrapped; may vary a little for bfd)."""
        return len(self.epoch_batches(epoch))

    def _plan_epoch(self, epoch: int) -> list[MicroBatch]:
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        if self.packing == "off":
            rows = [[Segment(i, 0, self.lengths[i])] for i in order]
        else:
            pack = pack_bfd if self.packing == "bfd" else pack_wrapped
            packed = pack([self.lengths[i] for i in order], self.max_seq_len)
            # packers index the shuffled list; map back to dataset sample indices
            rows = [[Segment(order[s.sample], s.start, s.end) for s in row] for row in packed]
            if self.packing == "bfd":
                rng.shuffle(rows)
        size = self.micro_batch_size
        batches = [rows[k : k + size] for k in range(0, len(rows), size)]
        if self.drop_last and batches and len(batches[-1]) < size:
            batches.pop()
        return batches


def iterate_micro_batches(
    plan: MicroBatchPlan, cursor: DataCursor
) -> Iterator[tuple[DataCursor, MicroBatch]]:
    """Yield (cursor after this micro-batch, its rows) forever, across epochs, starting at `cursor`.

    The yielded cursor names the next micro-batch (`DataCursor(epoch + 1, 0)` after
    an epoch's last one), so saving it and resuming from it continues exactly.
    """
    epoch, batch = cursor.epoch, cursor.batch
    available = plan.num_batches(epoch)
    if batch > available:
        raise DataError(
            f"data cursor (epoch {epoch}, batch {batch}) is past the end of the epoch ({available} micro-batches);"
            " has the dataset or the batching config changed since the snapshot?"
        )
    while True:
        batches = plan.epoch_batches(epoch)
        while batch < len(batches):
            rows = batches[batch]
            batch += 1
            after = DataCursor(epoch, batch) if batch < len(batches) else DataCursor(epoch + 1, 0)
            yield after, rows
        epoch, batch = epoch + 1, 0
