"""DataBuffer: per-epoch deterministic shuffles, epoch crossing, and exact resume from a JSON cursor."""

from __future__ import annotations

import json

import pytest

from rollout.errors import ConfigError, DataError
from rollout.rl.buffer import DataBuffer, epoch_order


def test_each_epoch_is_a_permutation_and_take_crosses_epochs() -> None:
    buffer = DataBuffer(7, seed=3)
    drawn = buffer.take(7 * 3 + 2)
    epochs = [drawn[0:7], drawn[7:14], drawn[14:21]]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(7))
        assert order == epoch_order(7, 3, e)
    assert epochs[0] != epochs[1]  # a fresh shuffle per epoch
    assert drawn[21:] == epoch_order(7, 3, 3)[:2]
    assert (buffer.epoch, buffer.position) == (3, 2)


def test_same_seed_same_order_other_seed_other_order() -> None:
    assert DataBuffer(50, seed=1).take(60) == DataBuffer(50, seed=1).take(60)
    assert DataBuffer(50, seed=1).take(50) != DataBuffer(50, seed=2).take(50)


@pytest.mark.parametrize("first", [0, 3, 7, 10])
def test_resume_from_a_json_cursor_gives_the_same_indices(first: int) -> None:
    straight = DataBuffer(7, seed=5)
    straight.take(first)
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = DataBuffer(7, seed=5)
    resumed.load_state_dict(state)
    assert resumed.take(3) + resumed.take(11) == straight.take(14)


def test_load_rejects_another_dataset_or_seed() -> None:
    state = DataBuffer(7, seed=5).state_dict()
    with pytest.raises(ConfigError, match="saved for 7 rows, but the dataset has 8"):
        DataBuffer(8, seed=5).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with seed 5, but this run uses seed 6"):
        DataBuffer(7, seed=6).load_state_dict(state)
    with pytest.raises(DataError, match="no rows"):
        DataBuffer(0, seed=0)
    assert DataBuffer(3, seed=0).take(0) == []
