"""`make bench`'s repeat loop (`benchmarks/run_all.py`, `Repeats`): when it stops, fed figures by
stub sides (the loop is ours; the figures stand in for timings)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    import run_all
finally:
    sys.path.remove(BENCHMARKS)  # its modules' names (generation, machine, ...) stay out of other tests' way


def _args() -> argparse.Namespace:
    return argparse.Namespace(min_repeats=3, max_repeats=4, close_repeats=6, budget_s=1e9)


def _repeats(rollout: list[float], bare: list[float]) -> int:
    """How many repeats the `sft-padded` job runs when repeat r's sides read rollout[r] and bare[r]."""
    sides = {"rollout": lambda r: (rollout[r], {}), "bare": lambda r: (bare[r], {})}
    ratios = {"rollout/bare": lambda f: f["rollout"] / f["bare"]}
    out = run_all.Repeats(_args(), "sft-padded").run(sides, ratios)
    assert out["figures"]["rollout"] == rollout[: len(out["figures"]["rollout"])]
    return len(out["ratios"]["rollout/bare"])


@pytest.mark.parametrize(("values", "expected"), [
    ([0.80, 0.81, 0.80], False),  # all below the 0.95 target, median far: settled
    ([1.20, 1.21, 1.19], False),
    ([0.90, 0.91, 0.92], True),  # median within 10% of the target
    ([0.72, 0.80, 0.98], True),  # median 0.80, but one repeat above 0.95: not settled
    ([0.96, 1.30, 1.25], False),  # all above: met, however noisy
])
def test_a_ratio_is_unsettled_near_its_target_or_while_its_repeats_straddle_it(values, expected):
    assert run_all.unsettled(values, 0.95) is expected


def test_stable_ratios_far_from_the_target_stop_at_the_minimum_repeats():
    assert _repeats([8.0] * 6, [10.0] * 6) == 3  # 0.80 every time


def test_repeats_that_straddle_the_target_run_on_to_the_close_cap():
    """0.72, 0.80, 0.98, 0.80, ...: the median is stable at 0.80 (a "NO" against 0.95) from the
    fourth repeat, where the median-only rule stopped; one repeat read above the target, so the
    loop runs on to `close_repeats`."""
    assert _repeats([7.2, 8.0, 9.8, 8.0, 8.0, 8.0], [10.0] * 6) == 6
