"""Reward functions loaded by the RL tests through `module:attr`."""

from __future__ import annotations

CALLS = {"n": 0}


def flaky_reward(prompts, completions, **fields):
    """Raises on its 1st and 3rd call (a whole generation round), scores 1.0 otherwise."""
    CALLS["n"] += 1
    if CALLS["n"] in (1, 3):
        raise RuntimeError("scorer backend unavailable")
    return [1.0 if "1" in c else 0.0 for c in completions]


def text_length(prompts, completions, **fields):
    """Longer text scores higher: a signal even an untrained model's samples vary on."""
    return [len(c) / 10 for c in completions]


def text_length_on_odd_prompts(prompts, completions, **fields):
    """`text_length` for a prompt whose characters' codes sum to an odd number ("What is 8+7?"), 0 for
    the rest ("What is 5+1?"): a batch where some groups' rewards all tie (advantage exactly 0) and
    the others' vary."""
    return [len(c) / 10 if sum(map(ord, str(p))) % 2 else 0.0 for p, c in zip(prompts, completions, strict=True)]


class ThreeTurnEnv:
    """Three assistant turns whatever the model says, then done; each turn rewarded by its length
    (a signal an untrained model's samples vary on). Exercises multi-turn episodes end to end."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.turn = 0

    async def reset(self, row):
        return [dict(m) for m in row["prompt"]]

    async def step(self, message):
        from rollout.rl.types import StepResult

        self.turn += 1
        done = self.turn >= self.turns
        reply = () if done else ({"role": "user", "content": f"and {self.turn}?"},)
        return StepResult(reply, len(message["content"]) / 10, done)
