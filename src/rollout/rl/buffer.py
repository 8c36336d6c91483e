"""`DataBuffer`: which dataset rows the next prompts come from, deterministically and resumably.

    buffer = DataBuffer(len(rows), seed=0)
    buffer.take(4)                      # [17, 3, 250, 9]: row indices, crossing epochs as needed
    state = buffer.state_dict()         # {"num_rows": ..., "seed": 0, "epoch": 0, "position": 4}
    other = DataBuffer(len(rows), seed=0); other.load_state_dict(state)
    other.take(4) == buffer.take(4)     # True

Epoch `e` visits every row once in the order of `random.Random(f"{seed}:{e}")`
shuffling `range(num_rows)`: a pure function of (seed, epoch), so the cursor
(epoch, position) is all the state there is (saved in snapshots as JSON).
"""

from __future__ import annotations

import random
from typing import Any

from rollout.errors import ConfigError, DataError


class DataBuffer:
    """An endless, epoch-wise shuffled stream of row indices with a JSON-able cursor."""

    def __init__(self, num_rows: int, *, seed: int) -> None:
        if num_rows < 1:
            raise DataError(f"the prompt dataset has no rows (num_rows={num_rows})")
        self.num_rows = num_rows
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = epoch_order(num_rows, seed, 0)

    def take(self, k: int) -> list[int]:
        """The next `k` row indices; an epoch boundary starts the next epoch's order."""
        if k < 0:
            raise ValueError(f"take(k) needs k >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = epoch_order(self.num_rows, self.seed, self.epoch)
            step = min(k - len(out), self.num_rows - self.position)
            out.extend(self._order[self.position : self.position + step])
            self.position += step
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a cursor saved by `state_dict` (for the same dataset size and seed)."""
        if int(state["num_rows"]) != self.num_rows:
            raise ConfigError(
                f"the data buffer state was saved for {state['num_rows']} rows, but the dataset has"
                f" {self.num_rows}: resume with the same prompt dataset"
            )
        if int(state["seed"]) != self.seed:
            raise ConfigError(
                f"the data buffer state was saved with seed {state['seed']}, but this run uses seed"
                f" {self.seed}: resume with the same seed"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_rows:
            raise ConfigError(f"bad data buffer cursor: epoch {epoch}, position {position}")
        self.epoch, self.position = epoch, position
        self._order = epoch_order(self.num_rows, self.seed, epoch)


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch (a string seed: `random` hashes it with sha512, stable across runs)."""
    order = list(range(num_rows))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order
