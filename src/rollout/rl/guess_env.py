"""The `guess_number` env (SPEC section 9): find a secret integer by binary search, over several turns.

    env = GuessNumberEnv(decay=True)                   # [algorithm.grpo.env] options, as keyword arguments
    messages = await env.reset({"prompt": [{"role": "user", "content": "..."}], "n": 16, "secret": 11})
    step = await env.step({"role": "assistant", "content": "Guess: 8"})
    # step.messages == ({"role": "user", "content": "higher"},), reward 0.0, done False
    step = await env.step({"role": "assistant", "content": "Guess: 11"})   # reward 1.0 (0.9375 with decay), done

The secret comes from the row (`rollout data guess-number` draws it from its
seed; see `tasks/guess_number.py`): every completion of a prompt plays the
same game, and a resumed run replays it exactly. A row's "n" (else the `n`
option) bounds the game to [1, n]; the row's "prompt" (else the standard
question) opens it.

Each assistant turn is one guess in the strict grammar of
`tasks.guess_number.parse_guess` ("Guess: 8" or a bare "8"). The env answers
"higher", "lower", or ends the episode on a correct guess. A reply that is not
a guess, or a guess outside [1, n], gets a corrective user message and still
uses a turn. Reward: 1.0 on the correct guess, 0 on every other turn, so the
episode's return is 1 exactly when the number was found within the turns it
had. With `decay = true` the correct guess at turn t (1-based) earns
`1 - (t - 1) / T`, T being the `max_turns` option if set, else n: 1.0 at the
first guess, falling linearly (for n = 16 and no cap, binary search's worst
case of 5 guesses earns 0.75).

With `progress = w > 0` every guess also earns w times the share of the
search it did: `(log2 |S| - log2 |S'|) / log2 n`, S the numbers still
possible before the guess (consistent with every answer so far), S' after
it ({secret} after the correct guess). A found secret then adds exactly w to
the episode's return whatever the path; a game that runs out of turns keeps
w times the bits it learned (a guess at the middle of S learns one bit, a
guess outside S or an invalid reply none). A denser signal than success
alone for RL: a failed search that halved the interval scores above one that
nibbled at its edge. 0 (default) leaves the rewards above unchanged; n = 1
has nothing to learn and earns no progress reward.

Turns are capped by the episode's `max_turns` (the loop ends the episode,
return 0). The env's own `max_turns` option also ends it, with done and
reward 0 after that many guesses without success, which makes the env
self-contained for a caller without an episode loop; set both alike when
using `decay`. An optimal search needs at most `n.bit_length()` guesses.

info: guess (None when the reply was not a guess), feedback ("higher",
"lower", "correct", "invalid", "out_of_range"), turn, secret, and
out_of_turns when the env's own `max_turns` ended the game.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from rollout.config_base import StrictModel, format_validation_errors
from rollout.errors import ConfigError, DataError
from rollout.inference.types import Message
from rollout.rl.types import StepResult
from rollout.tasks.guess_number import DEFAULT_N, MAX_N, answer_guess, parse_guess, question

ENV_NAME = "guess_number"


class GuessNumberEnvOptions(StrictModel):
    """The `options` table of a `guess_number` env."""

    n: int = Field(DEFAULT_N, ge=1, le=MAX_N, description='Upper bound of the secret when a row has no "n".')
    decay: bool = Field(False, description="Reward 1 - (t-1)/T for a correct guess at turn t (T: max_turns, else n).")
    max_turns: int | None = Field(
        None, ge=1, le=10_000, description="Guesses before the env ends the episode itself (None: the episode's cap)."
    )
    progress: float = Field(
        0.0, ge=0.0, le=100.0, allow_inf_nan=False,
        description="Weight w of the per-guess reward w * (bits learned) / log2 n (0: success reward only).",
    )


class GuessNumberEnv:
    """One game: guesses until the secret is found (or the turns run out)."""

    def __init__(self, **options: Any) -> None:
        try:
            self.options = GuessNumberEnvOptions.model_validate(options)
        except ValidationError as err:
            problems = [f"env {ENV_NAME}: options.{p}" for p in format_validation_errors(err, options)]
            known = ", ".join(GuessNumberEnvOptions.model_fields)
            raise ConfigError(f"{problems[0]} (known options: {known})", details=problems[1:]) from None
        self._n = self.options.n
        self._secret: int | None = None
        self._turn = 0
        self._low, self._high = 1, self._n  # the numbers still possible

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        n = row.get("n", self.options.n)
        secret = row.get("secret")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise DataError(f'the {ENV_NAME} env: a row\'s "n" must be an integer in 1..{MAX_N}, got {n!r}')
        if isinstance(secret, bool) or not isinstance(secret, int) or not 1 <= secret <= n:
            raise DataError(
                f'the {ENV_NAME} env needs an integer "secret" in 1..{n} in every prompt row, got {secret!r}'
                " (make rows with `rollout data guess-number`)"
            )
        self._n, self._secret, self._turn = n, secret, 0
        self._low, self._high = 1, n
        prompt = row.get("prompt") or question(n)
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    async def step(self, assistant_message: Message) -> StepResult:
        if self._secret is None:
            raise RuntimeError("GuessNumberEnv.step called before reset")
        self._turn += 1
        guess = parse_guess(assistant_message.get("content") or "")
        info: dict[str, Any] = {"guess": guess, "turn": self._turn, "secret": self._secret}
        progress = 0.0
        if guess is None:
            info["feedback"] = "invalid"
            reply = f'Invalid reply. Answer with only "Guess: N", N an integer from 1 to {self._n}.'
        elif not 1 <= guess <= self._n:
            info["feedback"] = "out_of_range"
            reply = f"{guess} is out of range: guess an integer from 1 to {self._n}."
        else:
            info["feedback"] = reply = answer_guess(self._secret, guess)
            progress = self._narrow(guess, reply)
            if reply == "correct":
                return StepResult((), self._reward() + progress, True, info)
        if self.options.max_turns is not None and self._turn >= self.options.max_turns:
            info["out_of_turns"] = True
            return StepResult((), progress, True, info)
        return StepResult(({"role": "user", "content": reply},), progress, False, info)

    def _narrow(self, guess: int, reply: str) -> float:
        """Shrink the numbers still possible by the answer; the `progress` reward for it."""
        before = self._high - self._low + 1
        if reply == "correct":
            self._low = self._high = guess
        elif reply == "higher":
            self._low = max(self._low, guess + 1)
        else:
            self._high = min(self._high, guess - 1)
        if not self.options.progress or self._n == 1:
            return 0.0
        after = self._high - self._low + 1
        return self.options.progress * (math.log2(before) - math.log2(after)) / math.log2(self._n)

    def _reward(self) -> float:
        """1.0, or with `decay` 1 - (t-1)/T for a correct guess at turn t."""
        if not self.options.decay:
            return 1.0
        horizon = self.options.max_turns if self.options.max_turns is not None else self._n
        return max(0.0, 1.0 - (self._turn - 1) / horizon)
