"""The guess-the-number task: find a secret integer in [1, n] from "higher" / "lower" answers.

    rollout data guess-number ./data/guess                       # n = 16: 1000 sft traces, 2000 RL, 200 eval
    rollout data guess-number ./data/guess64 --n 64 --train 4000 --seed 1

Files (JSON lines):

- `sft.jsonl`: `{"messages": [...]}` traces of an optimal binary search: the
  user's question, then per turn the assistant's "Guess: 8" and the env's
  answer ("higher" / "lower"), ending with the assistant's correct guess
  (the env answers "correct" by ending the episode, so no message follows).
  The guess is always the middle of the interval still possible, rounded
  down: at most `n.bit_length()` guesses (5 for n = 16).
- `prompts.jsonl` / `eval_prompts.jsonl`: `{"prompt": [user turn], "n": 16,
  "secret": 11}` rows for GRPO/PPO with the `guess_number` env and for
  `rollout eval`.

The secret is in the row, drawn here from the seed, not by the env: every
completion of a prompt (a GRPO group) plays the same game, eval sets are
fixed, and resume replays exactly. With n = 16 there are only 16 games, so
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


def sft_trace(n: int, secret: int) -> list[dict[str, str]]:
    """question -> (Guess, higher/lower)* -> the correct Guess."""
    messages = [{"role": "user", "content": question(n)}]
    for guess in binary_search_guesses(n, secret):
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
) -> dict[str, Path]:
    """Write `sft.jsonl`, `prompts.jsonl` and `eval_prompts.jsonl`; return {name: path}.

    Secrets are uniform in [1, n], from `random.Random(f"{seed}:sft")`,
    `f"{seed}:train"` and `f"{seed}:eval"`.
    """
    check_n(n)
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

    files = {
        "sft": [{"messages": sft_trace(n, s)} for s in draw_secrets("sft", n_sft)],
        "prompts": [prompt_row(n, s) for s in draw_secrets("train", n_train)],
        "eval_prompts": [prompt_row(n, s) for s in draw_secrets("eval", n_eval)],
    }
    written: dict[str, Path] = {}
    for name, rows in files.items():
        path = out_dir / f"{name}.jsonl"
        write_jsonl(path, rows)
        written[name] = path
    return written
