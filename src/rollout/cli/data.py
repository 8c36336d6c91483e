"""`rollout data ...`: make datasets.

Examples:

    rollout data arithmetic ./data/arith
    rollout data arithmetic ./data/arith3 --ops "+-*" --max-operand 20 --num-train 8000 --seed 1
"""

from __future__ import annotations

from pathlib import Path

import typer

from rollout.errors import ConfigError
from rollout.tasks.arithmetic import write_arithmetic_dataset

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
    """Write the arithmetic task: sft, pref and prompts jsonl files plus their eval_ versions."""
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
