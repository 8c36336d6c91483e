"""A dataset read and tokenised once per `rollout train`: the plan's pass, handed to the recipe.

    rows, report, encoded = read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on="assistant")
    samples, stats, kept = cut_samples(encoded, s.packing.max_seq_len)

`rollout train` plans before it runs (`rollout.plan.make_plan`), and the plan reads every line
and tokenises it at full length to count what `packing.max_seq_len` would cut: the recipe's own
first step, which on a large dataset takes minutes. `make_plan(hand_off=True)` leaves what it
made here (`leave_prepared`) and the recipe's `read_encoded` takes it, once, when everything it
depends on matches: the line kind, the dataset block, the model block (its tokenizer), `loss_on`
and each local source file's size and modification time. Anything else -- `rollout run --plan`
(the lock was planned in another process), a pipeline's stages, torchrun's ranks, a file
changed in between -- reads and tokenises as before, so the handoff changes no result, only
when the work is done. Prompt datasets (GRPO, PPO) hand over their rows only: their prompts
are rendered as the rollouts need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.data.sources import read_dataset
from rollout.data.tokenize import EncodedPair, EncodedSample, encode_pairs, encode_sft

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rollout.data.formats import LineKind
    from rollout.data.jsonl import DataReport, Row
    from rollout.data.sources import DatasetConfig

Encoded = list[EncodedSample] | list[EncodedPair]


@dataclass(frozen=True)
class _Prepared:
    key: tuple[Any, ...]
    rows: list[Row]
    report: DataReport
    encoded: Encoded | None


_left: list[_Prepared] = []  # at most one: the plan of the `rollout train` running in this process


def prepared_key(dataset: DatasetConfig, kind: LineKind, *, model: BaseModel, loss_on: str | None) -> tuple[Any, ...]:
    """What rows and their tokens depend on (see the module docstring)."""
    return (kind, dataset.model_dump_json(), model.model_dump_json(), loss_on, _file_stamps(dataset))


def leave_prepared(key: tuple[Any, ...], rows: list[Row], report: DataReport, encoded: Encoded | None) -> None:
    """Keep the plan's rows (and their full-length tokens) for the recipe of this process's run."""
    _left[:] = [_Prepared(key, rows, report, encoded)]


def read_rows_prepared(
    dataset: DatasetConfig, kind: LineKind, *, model: BaseModel
) -> tuple[list[Row], DataReport]:
    """`read_dataset`, or the rows the plan left for this dataset."""
    left = _take(prepared_key(dataset, kind, model=model, loss_on=None))
    return (left.rows, left.report) if left is not None else read_dataset(dataset, kind)


def read_encoded(
    dataset: DatasetConfig, kind: LineKind, tokenizer: Any, *, model: BaseModel, loss_on: str | None = None
) -> tuple[list[Row], DataReport, Encoded]:
    """The dataset's rows and each line's full-length tokens (`encode_sft` for "sft" and "kto"
    lines with `loss_on`, `encode_pairs` for "preference"), from the plan when it left them."""
    left = _take(prepared_key(dataset, kind, model=model, loss_on=loss_on))
    if left is not None and left.encoded is not None:
        return left.rows, left.report, left.encoded
    rows, report = read_dataset(dataset, kind)
    return rows, report, encode_lines(rows, kind, tokenizer, loss_on=loss_on)


def encode_lines(rows: Sequence[Row], kind: LineKind, tokenizer: Any, *, loss_on: str | None) -> Encoded:
    """The full-length tokens of checked rows of `kind` (not "prompt": those are rendered per rollout)."""
    if kind == "preference":
        return encode_pairs(rows, tokenizer)
    if kind in ("sft", "kto") and loss_on is not None:
        return encode_sft(rows, tokenizer, loss_on=loss_on)  # type: ignore[arg-type]  # checked by the config
    raise ValueError(f"no full-length tokens for {kind!r} lines (loss_on={loss_on!r})")


def _take(key: tuple[Any, ...]) -> _Prepared | None:
    found = next((p for p in _left if p.key == key), None)
    _left.clear()  # taken or stale: either way not kept past the recipe's first read
    return found


def _file_stamps(dataset: DatasetConfig) -> tuple[tuple[str, int, int], ...]:
    stamps = []
    for source in dataset.sources if dataset.kind == "mixture" else (dataset,):
        path = Path(source.path)
        if path.is_file():
            stat = path.stat()
            stamps.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
        elif path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                stat = file.stat()
                stamps.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)
