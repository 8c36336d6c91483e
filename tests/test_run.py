"""rollout.run: the pieces of a run every loop shares (no training here, no torch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.algorithms.config import RMConfig, SFTConfig
from rollout.checkpoint import snapshot_due
from rollout.config import parse_config
from rollout.errors import ConfigError
from rollout.run import resolve_total_steps, settings_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_settings_for_narrows_or_refuses_another_algorithms_config():
    cfg = parse_config((EXAMPLES / "sft-tiny.toml").read_text(), source=EXAMPLES / "x.toml")
    assert isinstance(settings_for(cfg, SFTConfig), SFTConfig)
    with pytest.raises(ConfigError, match="algorithm.kind is 'sft': its settings are not RMConfig"):
        settings_for(cfg, RMConfig)


def test_total_steps_from_each_budget():
    per = dict(batches_per_epoch=10, grad_accum=2, tokens_per_batch=100.0)
    assert resolve_total_steps(max_steps=7, max_epochs=None, max_tokens=None, **per) == 7
    assert resolve_total_steps(max_steps=None, max_epochs=1.5, max_tokens=None, **per) == 7
    assert resolve_total_steps(max_steps=None, max_epochs=None, max_tokens=1000, **per) == 5


@pytest.mark.parametrize(
    ("every", "step", "total", "taken", "due"),
    [
        (None, 4, 10, 1, False),
        (2, 4, 10, 1, True),
        (2, 5, 10, 1, False),
        (4, 10, 10, 1, False),  # the final snapshot covers the last step
        (4, 5, 10, 2, True),  # two steps per batch crossed 4
        (4, 6, 10, 2, False),
    ],
)
def test_snapshot_due(every, step, total, taken, due):
    assert snapshot_due(every, step, total, steps_taken=taken) is due
