"""Plugins for the RL tests, loaded through `module:attr` references (a unique module name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.rl.types import StepResult

NOT_CALLABLE = 42


def length_reward(prompts, completions, **fields):
    """A user reward function: the completion length in characters."""
    return [float(len(c)) for c in completions]


class TwoTurnEnv:
    """A multi-turn env: asks a follow-up question once, then ends."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.turns = 0
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, assistant_message: Mapping[str, str]) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(({"role": "user", "content": "Are you sure?"},), 0.0, False)
        return StepResult((), 1.0, True)
