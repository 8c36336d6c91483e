"""The guess-the-number task: find a secret integer in [1, n] from "higher" / "lower" answers.

    rollout data guess-number ./data/guess                       # n = 16: 1000 sft traces, 2000 RL, 200 eval
    rollout data guess-number ./data/guess64 --n 64 --train 4000 --seed 1

Files (JSON lines):

- `sft.jsonl`: `{"messages": [...]}` search traces: the user's question,
  then per turn the assistant's "Guess: 8" and the env's answer ("higher" /
  "lower"), ending with the assistant's correct guess (the env answers
  "correct" by ending the episode, so no message follows). `strategy`
  picks the search (`SFT_STRATEGIES`):
  - "binary" (default): optimal; the guess is always the middle of the
    interval still possible, rounded down: at most `n.bit_length()` guesses
    (5 for n = 16).
  - "random": valid but slower; each guess is uniform among the numbers
    still consistent with every answer so far (never a wasted guess, about
    2 ln n guesses on average: 4.2 for n = 16, where 58% of games end
    within 4 guesses against 94% for binary search). A start RL can
    improve on: capping the episode's turns rewards searches nearer the
    middle.
  - "mixed": each guess is the middle (as "binary") with probability 1/2,
    else drawn as "random": 72% of games within 4 guesses for n = 16. A
    policy that has the binary search as its most likely move but not yet
    reliably, which RL sharpens.
- `prompts.jsonl` / `eval_prompts.jsonl`: `{"prompt": [user turn], "n": 16,
  "secret": 11}` rows for GRPO/PPO with the `guess_number` env and for
  `rollout eval`.

The secret is in the row, drawn here from the seed, not by the env: every
completion of a prompt (a GRPO group) plays the same game, eval sets are
fixed, and resume replays exactly. "random" traces draw their guesses from
their own stream (`f"{seed}:sft-guesses"`), so both strategies play the same
secrets. With n = 16 there are only 16 games, so
eval rows are not disjoint from training ones: the task is the search
strategy, not the numbers. sft, train and eval draws use independent
streams (`random.Random(f"{seed}:sft")`, ...). Same arguments, same bytes.

The reply grammar (`parse_guess`) is strict on purpose: a reply is the
guess alone, "Guess: 8" or "8" (case-insensitive, an optional ":" or "=",
a final "." or "!"), after an optional leading `<think>...</think>` block.
Anything else is invalid and the env says so (the turn still counts).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Literal

from rollout.errors import ConfigError
from rollout.tasks.arithmetic import write_jsonl

DEFAULT_N = 16
MAX_N = 1_000_000_000
Answer = Literal["higher", "lower", "correct"]
Strategy = Literal["binary", "random", "mixed"]
SFT_STRATEGIES: tuple[Strategy, ...] = ("binary", "random", "mixed")
_GUESS = re.compile(r"\s*(?:guess\s*[:=]?\s*)?([+-]?\d{1,12})\s*[.!]?\s*", re.IGNORECASE)
_THINK = re.compile(r"\s*<think>.*?</think>", re.DOTALL)


def check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ConfigError(f"n must be an integer in 1..{MAX_N}, got {n!r}")


def question(n: int) -> str:
    """The opening user turn."""
    return (
        f"I'm thinking of an integer from 1 to {n}. Find it in as few guesses as possible."
        ' Reply with only "Guess: N". After each guess I answer "higher" (my number is larger),'
        ' "lower" (it is smaller) or "correct".'
    )


def guess_text(guess: int) -> str:
    """An assistant turn: "Guess: 8"."""
    return f"Guess: {guess}"


def parse_guess(text: str) -> int | None:
    """The integer of a reply that is only a guess ("Guess: 8", "8", "guess = 8."); None otherwise."""
    match = _GUESS.fullmatch(_THINK.sub("", text, count=1))
    return int(match.group(1)) if match else None


def answer_guess(secret: int, guess: int) -> Answer:
    """"higher" when the secret is larger than the guess, "lower" when smaller, else "correct"."""
    if secret > guess:
        return "higher"
    if secret < guess:
        return "lower"
    return "correct"


def binary_search_guesses(n: int, secret: int) -> list[int]:
    """The guesses of an optimal binary search for `secret` in [1, n] (lower middle), ending with it."""
    if not 1 <= secret <= n:
        raise ValueError(f"secret {secret} is not in 1..{n}")
    low, high, guesses = 1, n, []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        reply = answer_guess(secret, guess)
        if reply == "correct":
            return guesses
        low, high = (guess + 1, high) if reply == "higher" else (low, guess - 1)


def random_search_guesses(n: int, secret: int, rng: random.Random, middle: float = 0.0) -> list[int]:
    """A search ending with `secret` whose every guess is among the numbers still possible.

    Each guess is the middle of them (lower middle) with probability
    `middle`, else uniform among them; `middle = 0` never draws for it.
    """
    if not 1 <= secret <= n:
        raise ValueError(f"secret {secret} is not in 1..{n}")
    low, high, guesses = 1, n, []
    while True:
        guess = (low + high) // 2 if middle and rng.random() < middle else rng.randint(low, high)
        guesses.append(guess)
        reply = answer_guess(secret, guess)
        if reply == "correct":
            return guesses
        low, high = (guess + 1, high) if reply == "higher" else (low, guess - 1)


def sft_trace(n: int, secret: int, guesses: list[int] | None = None) -> list[dict[str, str]]:
    """question -> (Guess, higher/lower)* -> the correct Guess; `guesses` default to the binary search."""
    messages = [{"role": "user", "content": question(n)}]
    for guess in binary_search_guesses(n, secret) if guesses is None else guesses:
        messages.append({"role": "assistant", "content": guess_text(guess)})
        reply = answer_guess(secret, guess)
        if reply != "correct":
            messages.append({"role": "user", "content": reply})
    return messages


def prompt_row(n: int, secret: int) -> dict[str, Any]:
    """An RL / eval row: `{"prompt": [user turn], "n": 16, "secret": 11}`."""
    return {"prompt": [{"role": "user", "content": question(n)}], "n": n, "secret": secret}


def write_guess_number_data(
    out_dir: Path,
    *,
    seed: int = 0,
    n: int = DEFAULT_N,
    n_sft: int = 1000,
    n_train: int = 2000,
    n_eval: int = 200,
    strategy: str = "binary",
) -> dict[str, Path]:
    """Write `sft.jsonl`, `prompts.jsonl` and `eval_prompts.jsonl`; return {name: path}.

    Secrets are uniform in [1, n], from `random.Random(f"{seed}:sft")`,
    `f"{seed}:train"` and `f"{seed}:eval"`; `strategy` (`SFT_STRATEGIES`)
    is the search the SFT traces play.
    """
    check_n(n)
    if strategy not in SFT_STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(SFT_STRATEGIES)}, got {strategy!r}")
    for name, count in (("n_sft", n_sft), ("n_train", n_train), ("n_eval", n_eval)):
        if count < 1:
            raise ConfigError(f"{name} must be >= 1, got {count}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    def draw_secrets(stream: str, count: int) -> list[int]:
        rng = random.Random(f"{seed}:{stream}")
        return [rng.randint(1, n) for _ in range(count)]

    guess_rng = random.Random(f"{seed}:sft-guesses")

    def trace(secret: int) -> list[dict[str, str]]:
        if strategy != "binary":
            middle = 0.5 if strategy == "mixed" else 0.0
            return sft_trace(n, secret, random_search_guesses(n, secret, guess_rng, middle))
        return sft_trace(n, secret)

    files = {
        "sft": [{"messages": trace(s)} for s in draw_secrets("sft", n_sft)],
        "prompts": [prompt_row(n, s) for s in draw_secrets("train", n_train)],
        "eval_prompts": [prompt_row(n, s) for s in draw_secrets("eval", n_eval)],
    }
    written: dict[str, Path] = {}
    for name, rows in files.items():
        path = out_dir / f"{name}.jsonl"
        write_jsonl(path, rows)
        written[name] = path
    return written
