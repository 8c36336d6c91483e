"""`rollout data ...`: make datasets.

Examples:

    rollout data arithmetic ./data/arith
    rollout data arithmetic ./data/arith3 --ops "+-*" --max-operand 20 --num-train 8000 --seed 1
    rollout data calculator ./data/calc
    rollout data calculator ./data/calc4 --left-digits 4 --n-sft 500 --seed 1
    rollout data calculator ./data/calc45 --left 100-999 --right 10-99
    rollout data guess-number ./data/guess
    rollout data guess-number ./data/guess64 --n 64 --train 4000 --test 200 --seed 1
"""

from __future__ import annotations

from pathlib import Path

import typer

from rollout.errors import ConfigError

app = typer.Typer(help="Make datasets.", no_args_is_help=True)


def parse_ops(value: str) -> list[str]:
    """`"+-*"`, `"+,-,*"` or `"+ -"` -> `["+", "-", "*"]` (order kept, duplicates dropped)."""
    ops: list[str] = []
    for char in value:
        if char in ", ":
            continue
        if char not in ops:
            ops.append(char)
    if not ops:
        raise ConfigError(f"--ops: no operators in {value!r}")
    return ops


@app.command("arithmetic")
def arithmetic(
    out_dir: Path = typer.Argument(..., help="Directory to write the jsonl files to."),
    seed: int = typer.Option(0, help="Seed; train and eval lines use independent streams derived from it."),
    num_train: int = typer.Option(4000, help="Training problems (lines per train file)."),
    num_eval: int = typer.Option(200, help="Evaluation problems (lines per eval_ file)."),
    min_operand: int = typer.Option(0, help="Smallest operand (>= 0)."),
    max_operand: int = typer.Option(9, help="Largest operand."),
    ops: str = typer.Option(
        "+", help='Operators to draw from, e.g. "+" or "+-*" (use --ops=-* if it starts with -).'
    ),
) -> None:
    """Write the arithmetic task: sft, pref, prompts, kto and rm_pref jsonl files plus their eval_ versions."""
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    written = write_arithmetic_dataset(
        out_dir,
        seed=seed,
        num_train=num_train,
        num_eval=num_eval,
        min_operand=min_operand,
        max_operand=max_operand,
        ops=parse_ops(ops),
    )
    for name, path in written.items():
        lines = num_train if not name.startswith("eval_") else num_eval
        typer.echo(f"{path}  ({lines} lines)")


@app.command("calculator")
def calculator(
    out_dir: Path = typer.Argument(..., help="Directory to write the jsonl files to."),
    seed: int = typer.Option(0, help="Seed; sft, train and eval lines use independent streams from it."),
    n_sft: int = typer.Option(8000, help="SFT traces (tool call, tool result, final answer) in sft.jsonl (tasks.calculator.DEFAULT_N_SFT)."),
    n_train: int = typer.Option(4000, help="RL prompts in prompts.jsonl."),
    n_eval: int = typer.Option(200, help="Distinct eval prompts in eval_prompts.jsonl (in no other file)."),
    left: str | None = typer.Option(
        None, help="Left operands LOW-HIGH; default 200-999 (with the default right, every product has 5 digits)."
    ),
    right: str | None = typer.Option(None, help="Right operands LOW-HIGH; default 50-99."),
    left_digits: int | None = typer.Option(None, help="Left operands of exactly this many digits (instead of --left)."),
    right_digits: int | None = typer.Option(None, help="Right operands of exactly this many digits (instead of --right)."),
    ops: str = typer.Option(
        "*", help='Operators to draw from, e.g. "*" or "+-*" (use --ops=-* if it starts with -).'
    ),
    direct_share: float = typer.Option(
        0.0, min=0.0, max=1.0, help="Share of SFT traces that answer without calling the tool (a start that seldom calls it)."
    ),
) -> None:
    """Write the calculator tool-use task: sft.jsonl, prompts.jsonl and eval_prompts.jsonl."""
    from rollout.tasks.calculator import DEFAULT_LEFT, DEFAULT_RIGHT, resolve_operands, write_calculator_data

    written = write_calculator_data(
        out_dir,
        seed=seed,
        n_sft=n_sft,
        n_train=n_train,
        n_eval=n_eval,
        left=resolve_operands(left, left_digits, DEFAULT_LEFT, "left"),
        right=resolve_operands(right, right_digits, DEFAULT_RIGHT, "right"),
        ops=parse_ops(ops),
        direct_share=direct_share,
    )
    lines = {"sft": n_sft, "prompts": n_train, "eval_prompts": n_eval}
    for name, path in written.items():
        typer.echo(f"{path}  ({lines[name]} lines)")


@app.command("guess-number")
def guess_number(
    out_dir: Path = typer.Argument(..., help="Directory to write the jsonl files to."),
    n: int = typer.Option(16, "--n", help="Secrets are integers from 1 to N."),
    seed: int = typer.Option(0, help="Seed; sft, train and eval secrets use independent streams from it."),
    n_sft: int = typer.Option(1000, "--n-sft", help="Search traces in sft.jsonl (see --strategy)."),
    n_train: int = typer.Option(2000, "--n-train", "--train", help="RL prompts in prompts.jsonl."),
    n_eval: int = typer.Option(200, "--n-eval", "--test", help="Eval prompts in eval_prompts.jsonl."),
    strategy: str = typer.Option(
        "binary", help='SFT traces: "binary" (optimal search), "random" (uniform among the numbers still possible)'
        ' or "mixed" (the middle half of the time, else random).'
    ),
) -> None:
    """Write the guess-the-number task: sft.jsonl, prompts.jsonl and eval_prompts.jsonl."""
    from rollout.tasks.guess_number import write_guess_number_data

    written = write_guess_number_data(
        out_dir, seed=seed, n=n, n_sft=n_sft, n_train=n_train, n_eval=n_eval, strategy=strategy
    )
    lines = {"sft": n_sft, "prompts": n_train, "eval_prompts": n_eval}
    for name, path in written.items():
        typer.echo(f"{path}  ({lines[name]} lines)")
