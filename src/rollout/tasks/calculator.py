"""The calculator task: multi-digit arithmetic a tiny model can't do in its head, solved by a tool call.

    rollout data calculator ./data/calc --n-sft 8000      # 8000 sft traces, 4000 RL prompts, 200 eval prompts
    rollout data calculator ./data/calc2 --left-digits 4 --seed 1
    rollout data calculator ./data/calc3 --left 100-999 --right 10-99   # 4- and 5-digit products

Files (JSON lines):

- `sft.jsonl`: `{"messages": [...]}` traces. The user asks "What is 123*45?",
  the assistant calls the tool (`<tool_call>{"name": "calculator", "arguments":
  {"expression": "123*45"}}</tool_call>`, the Hermes/Qwen format
  `rl.tools.parse_tool_calls` reads), the tool answers with what
  `rl.tools.calculator` returns, and the assistant ends with "The answer is
  5535.". Each row carries `"tools"` (the calculator's schema), which the
  SFT loader passes to the chat template, as the env does at RL time. With
  `--direct-share F` a share F of the traces answer at once without the call.
- `prompts.jsonl` / `eval_prompts.jsonl`: `{"prompt": [user turn], "answer":
  "5535"}` rows for GRPO/PPO with the `calculator` env and for `rollout eval`.

Problems are `left op right` with left and right drawn uniformly from their
ranges: by default 3-digit × 2-digit multiplication whose product always has
5 digits (200..999 × 50..99, `DEFAULT_LEFT` / `DEFAULT_RIGHT`). Eval problems come from
their own RNG stream and are distinct; sft and train problems never equal an
eval problem. Same arguments, same bytes.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.errors import ConfigError
from rollout.rl.calc import calculator
from rollout.rl.tools import Tool, tool_from_function
from rollout.tasks.arithmetic import OPS, Problem, write_jsonl

TOOL_NAME = "calculator"
DEFAULT_LEFT = (200, 999)
DEFAULT_RIGHT = (50, 99)
"""3-digit x 2-digit products, all of 5 digits (10000..98901). With a single result length the final
answer's digits stand at a fixed distance from the tool result's, and the tiny model learned to copy
them by step ~400 at batch 32 on every seed and float path measured (examples/tools-sft-tiny.toml).
With 4- and 5-digit results (100..999 x 10..99) the copy depends on the content; it took 500 to
2000+ steps at batch 32 depending on the seed, the thread count and the CPU's kernels, and a
competing shortcut could hold it off for good."""
MAX_DIGITS = 30
"""Per operand, so every result stays far inside the calculator's 100-digit limit."""
DEFAULT_N_SFT = 8000
"""SFT traces by default: 3.2 epochs in the tools SFT example (batch 32 x 800 steps)."""
FINAL_ANSWER = "The answer is {answer}."
_NUMBER = re.compile(r"(?<!\d)-?\d+(?:\.\d+)?")
"""A minus sign right after a digit is an operator ("5-3" holds 5 and 3), not a sign."""


def calculator_tool() -> Tool:
    """The built-in calculator as a `Tool` (schema from its hints and docstring)."""
    return tool_from_function(calculator, name=TOOL_NAME)


def digits_range(digits: int) -> tuple[int, int]:
    """The operands with exactly `digits` digits: 3 -> (100, 999); 1 -> (0, 9)."""
    if not 1 <= digits <= MAX_DIGITS:
        raise ConfigError(f"operand digits must be in 1..{MAX_DIGITS}, got {digits}")
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def operand_range(text: str) -> tuple[int, int]:
    """`"200-999"` -> (200, 999); a single number `"7"` -> (7, 7). `ConfigError` for anything else."""
    low, sep, high = text.strip().partition("-")
    try:
        bounds = (int(low), int(high if sep else low))
    except ValueError:
        raise ConfigError(f"operand range must be LOW-HIGH with whole numbers >= 0, e.g. 200-999; got {text!r}") from None
    if any(len(str(bound)) > MAX_DIGITS for bound in bounds):
        raise ConfigError(f"operand range {text!r}: at most {MAX_DIGITS} digits per operand")
    return bounds


def resolve_operands(range_text: str | None, digits: int | None, default: tuple[int, int], name: str) -> tuple[int, int]:
    """The operand range from `--<name> LOW-HIGH` or `--<name>-digits D` (not both), else `default`."""
    if range_text is not None and digits is not None:
        raise ConfigError(f"give --{name} or --{name}-digits, not both")
    if range_text is not None:
        return operand_range(range_text)
    if digits is not None:
        return digits_range(digits)
    return default


def validate_calculator_args(
    *, left: tuple[int, int], right: tuple[int, int], ops: Sequence[str], n_eval: int
) -> None:
    """`ConfigError` for empty or negative ranges, unknown ops, or an eval split too big to keep apart."""
    for name, (low, high) in (("left", left), ("right", right)):
        if low < 0:
            raise ConfigError(f"{name} operands must be >= 0, got the range {low}..{high}")
        if low > high:
            raise ConfigError(f"{name} operand range is empty: {low}..{high}")
    if not ops:
        raise ConfigError(f"ops must name at least one of {' '.join(OPS)}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(f"unknown op(s) {' '.join(map(repr, unknown))}: expected one of {' '.join(OPS)}")
    space = (left[1] - left[0] + 1) * (right[1] - right[0] + 1) * len(set(ops))
    if n_eval > space // 2:
        raise ConfigError(
            f"n_eval ({n_eval}) must be at most half of the {space} distinct problems, so that training"
            " problems can stay disjoint from eval ones"
        )


def draw_problem(
    rng: random.Random, *, left: tuple[int, int], right: tuple[int, int], ops: Sequence[str]
) -> Problem:
    """The op, then the left and right operands, each uniform over its range."""
    op = rng.choice(list(ops))
    return Problem(rng.randint(*left), op, rng.randint(*right))


def expression_of(problem: Problem) -> str:
    """What the assistant passes to the calculator: "123*45"."""
    return f"{problem.left}{problem.op}{problem.right}"


def tool_call_text(expression: str) -> str:
    """The assistant's call, `<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def sft_trace(problem: Problem) -> list[dict[str, str]]:
    """user question -> assistant tool call -> tool result -> assistant final answer."""
    expression = expression_of(problem)
    result = calculator(expression)  # the tool's real output, exactly what the env would send back
    assert result == str(problem.answer), (expression, result)
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": tool_call_text(expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": FINAL_ANSWER.format(answer=result)},
    ]


def direct_trace(problem: Problem) -> list[dict[str, str]]:
    """user question -> assistant final answer, no tool call (the tool is offered, not used)."""
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": FINAL_ANSWER.format(answer=problem.answer)},
    ]


def prompt_row(problem: Problem) -> dict[str, Any]:
    """An RL / eval row: `{"prompt": [user turn], "answer": "5535"}`."""
    return {"prompt": [{"role": "user", "content": problem.question}], "answer": str(problem.answer)}


def draw_eval_problems(
    rng: random.Random, count: int, *, left: tuple[int, int], right: tuple[int, int], ops: Sequence[str]
) -> list[Problem]:
    """`count` distinct problems, in draw order (the caller checked that enough exist)."""
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < count:
        problem = draw_problem(rng, left=left, right=right, ops=ops)
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out


def draw_train_problems(
    rng: random.Random,
    count: int,
    *,
    left: tuple[int, int],
    right: tuple[int, int],
    ops: Sequence[str],
    exclude: set[Problem],
) -> list[Problem]:
    """`count` problems (repeats allowed) none of which is in `exclude` (at most half of all problems)."""
    out: list[Problem] = []
    while len(out) < count:
        problem = draw_problem(rng, left=left, right=right, ops=ops)
        if problem not in exclude:
            out.append(problem)
    return out


def balance_answer_lengths(pool: Sequence[Problem], count: int) -> list[Problem]:
    """`count` problems of `pool` taking each answer length (in characters) in turn, in pool order.

    With natural draws 4-digit products are ~20% of 3-digit x 2-digit ones, and a tiny model
    trained on them copies 5-digit tool results and garbles every 4-digit one (held-out pass@1
    stuck at ~0.78 = the 5-digit share). Equal shares make it copy by content, not by position.
    A length whose problems run out drops out of the rotation.
    """
    by_length: dict[int, list[Problem]] = {}
    for problem in pool:
        by_length.setdefault(len(str(problem.answer)), []).append(problem)
    queues = [iter(by_length[k]) for k in sorted(by_length)]
    out: list[Problem] = []
    while len(out) < count and queues:
        for queue in list(queues):
            problem = next(queue, None)
            if problem is None:
                queues.remove(queue)
            elif len(out) < count:
                out.append(problem)
    if len(out) < count:
        raise ConfigError(f"only {len(out)} sft problems could be drawn, {count} asked")
    return out


def write_calculator_data(
    out_dir: Path,
    *,
    seed: int = 0,
    n_sft: int = DEFAULT_N_SFT,
    n_train: int = 4000,
    n_eval: int = 200,
    left: tuple[int, int] = DEFAULT_LEFT,
    right: tuple[int, int] = DEFAULT_RIGHT,
    ops: Sequence[str] = ("*",),
    direct_share: float = 0.0,
) -> dict[str, Path]:
    """Write `sft.jsonl`, `prompts.jsonl` and `eval_prompts.jsonl`; return {name: path}.

    Eval problems come from `random.Random(f"{seed}:eval")`, sft ones from
    `f"{seed}:sft"` and RL ones from `f"{seed}:train"`; sft and train draws
    skip every eval problem. SFT traces come in equal shares per answer length
    (`balance_answer_lengths`); RL and eval prompts keep the natural mix.

    `direct_share` of the sft traces (`round(direct_share * n_sft)`, at places drawn from
    `f"{seed}:direct"`) answer at once without calling the tool (`direct_trace`; the tool is still
    offered): SFT on them gives a model that can call and copy but seldom does, the start from which
    GRPO has to learn that calling pays (examples/tools-cold-sft-tiny.toml).
    """
    if not 0.0 <= direct_share <= 1.0:
        raise ConfigError(f"direct_share must be in [0, 1], got {direct_share}")
    for name, count in (("n_sft", n_sft), ("n_train", n_train), ("n_eval", n_eval)):
        if count < 1:
            raise ConfigError(f"{name} must be >= 1, got {count}")
    validate_calculator_args(left=left, right=right, ops=ops, n_eval=n_eval)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    ranges: dict[str, Any] = {"left": left, "right": right, "ops": ops}
    eval_problems = draw_eval_problems(random.Random(f"{seed}:eval"), n_eval, **ranges)
    held_out = set(eval_problems)
    sft_problems = balance_answer_lengths(
        draw_train_problems(random.Random(f"{seed}:sft"), 8 * n_sft, **ranges, exclude=held_out), n_sft
    )
    train_problems = draw_train_problems(random.Random(f"{seed}:train"), n_train, **ranges, exclude=held_out)

    direct = set(random.Random(f"{seed}:direct").sample(range(n_sft), round(direct_share * n_sft)))
    tools = [calculator_tool().openai_schema()]
    files = {
        "sft": [
            {"messages": direct_trace(p) if i in direct else sft_trace(p), "tools": tools}
            for i, p in enumerate(sft_problems)
        ],
        "prompts": [prompt_row(p) for p in train_problems],
        "eval_prompts": [prompt_row(p) for p in eval_problems],
    }
    written: dict[str, Path] = {}
    for name, rows in files.items():
        path = out_dir / f"{name}.jsonl"
        write_jsonl(path, rows)
        written[name] = path
    return written


# --- scoring --------------------------------------------------------------------


def answer_from_text(text: str) -> str | None:
    """The last number in `text` as an integer string ("-18", "5535"; "007" -> "7", "5535.0" -> "5535").

    None when there is no number, or the last one is not a whole number ("2.5").
    A "-" counts as a sign unless it follows a digit: "5-3" ends with 3.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    last = matches[-1]
    whole, _, fraction = last.partition(".")
    if fraction.strip("0"):
        return None
    return str(int(whole))


def is_correct(text: str, answer: str) -> bool:
    """Whether the last integer of `text` equals `answer` (the calculator task's verifiable reward)."""
    got = answer_from_text(text)
    if got is None:
        return False
    expected = answer.strip()
    return got == expected or (re.fullmatch(r"-?\d+", expected) is not None and int(got) == int(expected))
