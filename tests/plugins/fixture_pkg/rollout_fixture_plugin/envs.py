"""An env plugin: `fixture_echo`, one turn, reward 1.0 when the reply repeats the prompt."""

from rollout.rl.types import StepResult


class EchoEnv:
    def __init__(self):
        self.prompt = None

    async def reset(self, row):
        self.prompt = row["prompt"]
        return [{"role": "user", "content": self.prompt}]

    async def step(self, message):
        return StepResult((), 1.0 if message["content"] == self.prompt else 0.0, True)
