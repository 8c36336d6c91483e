"""The shared synthetic task: small-integer arithmetic ("What is 3+8?" -> "11").

    rollout data arithmetic ./data/arith                          # 4000 train + 200 eval, a+b with a,b in 0..9
    rollout data arithmetic ./data/arith3 --ops "+-*" --max-operand 20 --seed 1

Examples, tests and benchmarks train on it: SFT on `sft.jsonl`, DPO on
`pref.jsonl`, the reward model PPO trains against on `rm_pref.jsonl` (the same
pairs, every tenth rejected side a non-answer), GRPO/PPO on `prompts.jsonl` (the `answer` field feeds the
verifiable reward `is_correct`). Evaluation files (`eval_*.jsonl`) come from an
independent RNG stream, so they are not a slice of the training draw (with
tiny operand ranges the same questions can still occur in both).
Everything is deterministic for a given seed: same arguments, same bytes.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.errors import ConfigError, DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPS = ("+", "-", "*")
SPLITS = ("train", "eval")
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One `left op right` question."""

    left: int
    op: str
    right: int

    @property
    def question(self) -> str:
        return f"What is {self.left}{self.op}{self.right}?"

    @property
    def answer(self) -> int:
        return apply_op(self.op, self.left, self.right)


def apply_op(op: str, left: int, right: int) -> int:
    """`left op right` for op in OPS."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ConfigError(f"unknown arithmetic op {op!r}: expected one of {' '.join(OPS)}")


def validate_task_args(*, min_operand: int, max_operand: int, ops: Sequence[str]) -> None:
    """Raise `ConfigError` unless 0 <= min_operand <= max_operand and every op is known."""
    if min_operand < 0:
        raise ConfigError(f"min_operand must be >= 0, got {min_operand}")
    if min_operand > max_operand:
        raise ConfigError(f"min_operand ({min_operand}) must be <= max_operand ({max_operand})")
    if not ops:
        raise ConfigError(f"ops must name at least one of {' '.join(OPS)}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(
            f"unknown arithmetic op(s) {' '.join(map(repr, unknown))}: expected one of {' '.join(OPS)}"
        )


def draw_problem(rng: random.Random, *, min_operand: int, max_operand: int, ops: Sequence[str]) -> Problem:
    """Draw the op, then the two operands uniformly from [min_operand, max_operand]."""
    op = rng.choice(list(ops))
    left = rng.randint(min_operand, max_operand)
    right = rng.randint(min_operand, max_operand)
    return Problem(left, op, right)


def make_problem(
    rng: random.Random, *, min_operand: int, max_operand: int, ops: Sequence[str]
) -> tuple[str, str]:
    """A (question, answer) pair, e.g. ("What is 3+8?", "11")."""
    validate_task_args(min_operand=min_operand, max_operand=max_operand, ops=ops)
    problem = draw_problem(rng, min_operand=min_operand, max_operand=max_operand, ops=ops)
    return problem.question, str(problem.answer)


def answer_range(op: str, *, min_operand: int, max_operand: int) -> tuple[int, int]:
    """The smallest and largest result `op` can give with operands in [min_operand, max_operand]."""
    if op == "+":
        return 2 * min_operand, 2 * max_operand
    if op == "-":
        return min_operand - max_operand, max_operand - min_operand
    return min_operand * min_operand, max_operand * max_operand  # "*", operands >= 0


def make_wrong_answer(rng: random.Random, problem: Problem, *, min_operand: int, max_operand: int) -> int:
    """A wrong answer for `problem`: half the time a near miss (±1..3), else uniform over the plausible range.

    Never equal to the right answer; never negative for ops that can't go
    negative (+ and * with non-negative operands).
    """
    right = problem.answer
    low, high = answer_range(problem.op, min_operand=min_operand, max_operand=max_operand)
    floor = low if problem.op != "-" else None
    if rng.random() < 0.5 or high - low < 1:
        near = [right + d for d in (-3, -2, -1, 1, 2, 3) if floor is None or right + d >= floor]
        return rng.choice(near)
    wrong = rng.randint(low, high - 1)  # skip the right answer by shifting values at or above it
    return wrong + 1 if wrong >= right else wrong


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _assistant(content: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": content}]


# Every NON_ANSWER_EVERY-th pair of `rm_pref` rejects an empty reply instead of a wrong answer. An RM
# that never saw a non-answer scores one near its centre, above most wrong answers, and PPO against
# it learns to answer nothing where it is unsure (seed 2: 22% of held-out samples empty, gain +0.107);
# with them, seeds 0-2 gained +0.31..+0.41 (README).
NON_ANSWER_EVERY = 10


def make_split_rows(
    rng: random.Random, count: int, *, min_operand: int, max_operand: int, ops: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """`count` problems rendered five ways: `{"sft", "pref", "prompts", "kto", "rm_pref"}`.

    KTO lines are unpaired: even-numbered problems carry the right answer
    (`label: true`), odd-numbered ones the wrong answer of their pair.
    `rm_pref` lines are `pref`'s, except that every `NON_ANSWER_EVERY`-th
    rejects an empty reply (no draw from `rng`: the other files do not move).
    """
    rows: dict[str, list[dict[str, Any]]] = {"sft": [], "pref": [], "prompts": [], "kto": [], "rm_pref": []}
    for i in range(count):
        problem = draw_problem(rng, min_operand=min_operand, max_operand=max_operand, ops=ops)
        answer = str(problem.answer)
        wrong = str(make_wrong_answer(rng, problem, min_operand=min_operand, max_operand=max_operand))
        rows["sft"].append({"messages": _user(problem.question) + _assistant(answer)})
        rows["pref"].append(
            {"prompt": _user(problem.question), "chosen": _assistant(answer), "rejected": _assistant(wrong)}
        )
        non_answer = i % NON_ANSWER_EVERY == NON_ANSWER_EVERY - 1
        rows["rm_pref"].append({**rows["pref"][-1], "rejected": _assistant("" if non_answer else wrong)})
        rows["prompts"].append({"prompt": _user(problem.question), "answer": answer})
        desirable = i % 2 == 0
        rows["kto"].append(
            {
                "prompt": _user(problem.question),
                "completion": _assistant(answer if desirable else wrong),
                "label": desirable,
            }
        )
    return rows


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """One JSON object per line, UTF-8, `\\n` endings; written to a temp file then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_arithmetic_dataset(
    out_dir: Path,
    *,
    seed: int = 0,
    num_train: int = 4000,
    num_eval: int = 200,
    min_operand: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
) -> dict[str, Path]:
    """Write sft/pref/prompts/kto/rm_pref jsonl files (+ `eval_` versions) and return {name: path}.

    Train lines come from `random.Random(f"{seed}:train")`, eval lines from
    `random.Random(f"{seed}:eval")`.
    """
    validate_task_args(min_operand=min_operand, max_operand=max_operand, ops=ops)
    if num_train < 1:
        raise ConfigError(f"num_train must be >= 1, got {num_train}")
    if num_eval < 1:
        raise ConfigError(f"num_eval must be >= 1, got {num_eval}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    written: dict[str, Path] = {}
    for split, count in (("train", num_train), ("eval", num_eval)):
        rng = random.Random(f"{seed}:{split}")
        rows = make_split_rows(rng, count, min_operand=min_operand, max_operand=max_operand, ops=ops)
        for kind, kind_rows in rows.items():
            name = kind if split == "train" else f"eval_{kind}"
            path = out_dir / f"{name}.jsonl"
            write_jsonl(path, kind_rows)
            written[name] = path
    return written


# --- scoring --------------------------------------------------------------------


def extract_answer(text: str) -> str | None:
    """The first integer in `text` ("-3" allowed), normalised ("007" -> "7"); None if there is none."""
    match = _INTEGER.search(text)
    return None if match is None else str(int(match.group()))


def is_correct(completion: str, answer: str) -> bool:
    """Whether the first integer of `completion` equals `answer` (the verifiable reward)."""
    got = extract_answer(completion)
    if got is None:
        return False
    expected = answer.strip()
    return got == expected or (_INTEGER.fullmatch(expected) is not None and int(got) == int(expected))


def _prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    prompt = row["prompt"]
    return _user(prompt) if isinstance(prompt, str) else list(prompt)


def greedy_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    *,
    batch_size: int = 64,
    max_new_tokens: int = 6,
) -> float:
    """Fraction of prompt rows (`{"prompt", "answer"}`) whose greedy completion `is_correct`.

    Prompts get the chat template with the generation prompt and are left-padded
    (the tokenizer's padding side is restored afterwards); only new tokens are
    decoded. `model` is anything with a transformers-style `generate`.
    """
    import torch

    if not rows:
        raise DataError("greedy_accuracy: no rows to score")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    device = getattr(model, "device", torch.device("cpu"))
    was_training = bool(getattr(model, "training", False))
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if was_training:
        model.eval()
    correct = 0
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    _prompt_messages(row), tokenize=False, add_generation_prompt=True
                )
                for row in batch
            ]
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                output_ids = model.generate(
                    **encoded,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new_ids = output_ids[:, encoded["input_ids"].shape[1] :]
            completions = tokenizer.batch_decode(new_ids, skip_special_tokens=True)
            correct += sum(
                is_correct(text, str(row["answer"])) for text, row in zip(completions, batch, strict=True)
            )
    finally:
        tokenizer.padding_side = padding_side
        if was_training:
            model.train()
    return correct / len(rows)
