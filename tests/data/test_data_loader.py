"""Epoch plans and the resumable micro-batch stream."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from rollout.data.loader import DataCursor, MicroBatchPlan, iterate_micro_batches
from rollout.data.packing import Segment
from rollout.errors import DataError

_RNG = random.Random(7)
LENGTHS = [_RNG.randint(1, 32) for _ in range(103)]


def make_plan(packing: str, **overrides) -> MicroBatchPlan:
    kwargs = {"micro_batch_size": 4, "packing": packing, "max_seq_len": 32, "seed": 3} | overrides
    return MicroBatchPlan(LENGTHS, **kwargs)


def take(plan: MicroBatchPlan, cursor: DataCursor, n: int):
    return list(itertools.islice(iterate_micro_batches(plan, cursor), n))


@pytest.mark.parametrize("packing", ["off", "bfd", "wrapped"])
def test_plans_are_deterministic_and_epochs_differ(packing):
    a, b = make_plan(packing), make_plan(packing)
    assert a.epoch_batches(0) == b.epoch_batches(0)
    assert a.epoch_batches(5) == b.epoch_batches(5)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    assert make_plan(packing, seed=4).epoch_batches(0) != a.epoch_batches(0)


def test_off_plan_covers_samples_once_and_drops_last():
    plan = make_plan("off")
    batches = plan.epoch_batches(0)
    assert plan.num_batches(0) == len(batches) == 103 // 4
    assert all(len(mb) == 4 and all(len(row) == 1 for row in mb) for mb in batches)
    seen = [row[0].sample for mb in batches for row in mb]
    assert len(set(seen)) == len(seen) == 100
    assert all(row[0] == Segment(row[0].sample, 0, LENGTHS[row[0].sample]) for mb in batches for row in mb)
    keep_all = make_plan("off", drop_last=False).epoch_batches(0)
    assert len(keep_all) == 26 and len(keep_all[-1]) == 3
    assert sorted(row[0].sample for mb in keep_all for row in mb) == list(range(103))


def test_off_order_is_the_documented_shuffle():
    order = list(range(len(LENGTHS)))
    random.Random("3:2").shuffle(order)
    batches = make_plan("off", drop_last=False).epoch_batches(2)
    assert [row[0].sample for mb in batches for row in mb] == order


def test_bfd_plan_respects_capacity_and_covers_samples():
    plan = make_plan("bfd", drop_last=False)
    for epoch in range(3):
        rows = [row for mb in plan.epoch_batches(epoch) for row in mb]
        assert all(sum(s.end - s.start for s in row) <= 32 for row in rows)
        assert sorted(s.sample for row in rows for s in row) == list(range(103))
        # bins are shuffled: not sorted by their first (longest) sample
        firsts = [LENGTHS[row[0].sample] for row in rows]
        assert firsts != sorted(firsts, reverse=True)


def test_wrapped_plan_covers_every_token():
    plan = make_plan("wrapped", drop_last=False)
    rows = [row for mb in plan.epoch_batches(0) for row in mb]
    tokens = sorted((s.sample, t) for row in rows for s in row for t in range(s.start, s.end))
    assert tokens == [(i, t) for i, n in enumerate(LENGTHS) for t in range(n)]
    assert all(sum(s.end - s.start for s in row) == 32 for row in rows[:-1])


@pytest.mark.parametrize("packing", ["off", "bfd", "wrapped"])
def test_resume_from_any_cursor_matches_uninterrupted(packing):
    plan = make_plan(packing)
    per_epoch = plan.num_batches(0)
    total = 3 * per_epoch + 2
    straight = take(plan, DataCursor(0, 0), total)
    # cursors advance one micro-batch at a time and roll over to the next epoch
    assert straight[per_epoch - 1][0] == DataCursor(1, 0)
    assert straight[0][0] == DataCursor(0, 1)
    for k in range(total - 1):
        cursor = straight[k][0]
        resumed_plan = make_plan(packing)  # a fresh process: no cache
        resumed = take(
            resumed_plan, DataCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))), total - k - 1
        )
        assert resumed == straight[k + 1 :], f"resume from {cursor}"


def test_iteration_yields_each_epoch_in_order():
    plan = make_plan("bfd")
    stream = take(plan, DataCursor(0, 0), plan.num_batches(0) + plan.num_batches(1))
    rows = [mb for _, mb in stream]
    assert rows == plan.epoch_batches(0) + plan.epoch_batches(1)
    # end-of-epoch cursor (epoch, num_batches) is accepted too
    end = DataCursor(0, plan.num_batches(0))
    assert take(plan, end, 1)[0][1] == plan.epoch_batches(1)[0]


def test_bad_cursor_and_tiny_dataset():
    plan = make_plan("off")
    with pytest.raises(DataError, match="past the end of the epoch"):
        next(iterate_micro_batches(plan, DataCursor(0, plan.num_batches(0) + 1)))
    with pytest.raises(DataError, match="invalid data cursor: batch"):
        DataCursor.from_dict({"epoch": 0, "batch": -1})
    with pytest.raises(DataError, match="invalid data cursor: epoch"):
        DataCursor.from_dict({"batch": 0})
    with pytest.raises(DataError, match="too small"):
        MicroBatchPlan([3, 4], micro_batch_size=4, packing="off", max_seq_len=8, seed=0)
    small = MicroBatchPlan([3, 4], micro_batch_size=4, packing="off", max_seq_len=8, seed=0, drop_last=False)
    assert small.num_batches(0) == 1
    with pytest.raises(ValueError, match="truncate first"):
        MicroBatchPlan([3, 9], micro_batch_size=1, packing="bfd", max_seq_len=8, seed=0)
    assert (
        MicroBatchPlan([3, 9], micro_batch_size=1, packing="wrapped", max_seq_len=8, seed=0).num_batches(0)
        == 2
    )


def test_plan_is_cached_and_the_same_across_processes():
    plan = make_plan("bfd")
    assert plan.epoch_batches(4) is plan.epoch_batches(4)
    code = (
        "import json, random\n"
        "from rollout.data.loader import MicroBatchPlan\n"
        f"plan = MicroBatchPlan({LENGTHS!r}, micro_batch_size=4, packing='bfd', max_seq_len=32, seed=3)\n"
        "print(json.dumps([[[[s.sample, s.start, s.end] for s in row] for row in mb] for mb in plan.epoch_batches(4)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout
    here = [[[[s.sample, s.start, s.end] for s in row] for row in mb] for mb in plan.epoch_batches(4)]
    assert json.loads(out) == here


def test_loader_does_not_import_torch():
    code = "import sys, rollout.data.loader; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
