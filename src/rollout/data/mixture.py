"""Weighted mixtures of datasets: a seeded interleave, made once, before training.

    rows = interleave_rows([sft_rows, chat_rows], weights=[3.0, 1.0], seed=0, stop="first_exhausted")

Each draw picks a source with probability weight / sum(weights) from
`random.Random(f"mixture:{seed}")` and takes that source's next row (in its
file order), as `datasets.interleave_datasets(probabilities=...)` does:

- `first_exhausted`: stop at the first draw of a source that has no row left
  (every row is used at most once; the mixture ends when the first source runs out);
- `all_exhausted`:   a source that runs out starts over; stop once every source
  has run out at least once (small sources are repeated, every row is used).

The mixture is a plain list of rows, the same in every process for the same
rows, weights and seed, so the loader's epoch shuffle and its saved cursor
(`rollout.data.loader.DataCursor`) resume a mixture exactly as they resume a
single file: the interleave needs no state of its own in a snapshot.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal, TypeVar

from rollout.errors import DataError

Stop = Literal["first_exhausted", "all_exhausted"]
STOPS = ("first_exhausted", "all_exhausted")

MAX_GROWTH = 20
"""`all_exhausted` refuses weights that would make the mixture this many times the total rows."""

T = TypeVar("T")


def interleave_rows(sources: Sequence[Sequence[T]], weights: Sequence[float], *, seed: int, stop: Stop) -> list[T]:
    """The mixed rows (see the module doc). Every source must have rows and a positive weight."""
    if len(sources) != len(weights) or not sources:
        raise ValueError(f"need one weight per source, got {len(weights)} weights for {len(sources)} sources")
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {', '.join(STOPS)}, got {stop!r}")
    if any(w <= 0 for w in weights) or any(not s for s in sources):
        raise ValueError("every source needs rows and a positive weight")
    total = sum(weights)
    if stop == "all_exhausted":
        expected = max(len(s) * total / w for s, w in zip(sources, weights, strict=True))
        budget = MAX_GROWTH * sum(len(s) for s in sources)
        if expected > budget:
            raise DataError(
                f"this mixture would repeat its sources about {expected / sum(len(s) for s in sources):.0f} times"
                f' to exhaust them all (weights {list(weights)}); use stop = "first_exhausted" or weights closer'
                " to the sources' sizes"
            )
    rng = random.Random(f"mixture:{seed}")
    positions = [0] * len(sources)
    exhausted = [False] * len(sources)
    indices = range(len(sources))
    out: list[T] = []
    while True:
        i = rng.choices(indices, weights)[0]
        if positions[i] == len(sources[i]):
            exhausted[i] = True
            if stop == "first_exhausted" or all(exhausted):
                return out
            positions[i] = 0
        out.append(sources[i][positions[i]])
        positions[i] += 1
