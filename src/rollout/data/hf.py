"""Read datasets through the Hugging Face `datasets` library, checking every row like a JSONL line.

    rows, report = read_hf_rows("sft", path=Path("data/train.parquet"))
    rows, report = read_hf_rows("prompt", path=Path("data/gsm8k"), split="test", columns={"question": "prompt"})
    report = scan_hf_dataset("preference", name="trl-lib/ultrafeedback_binarized")   # hub: online only

Where the rows come from (`path` or `name`, exactly one):

- a file: `.parquet`, `.arrow`, `.json` / `.jsonl` or `.csv` (one split, "train");
- a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read
  with `load_from_disk`; a `DatasetDict` folder holds the splits);
- any other folder: `load_dataset(folder)`, which finds the data files and
  their splits by name (`data/train-00000-of-00001.parquet`, a downloaded hub repo);
- `name`: a hub id, `load_dataset(name)` (needs the network; offline this is a clear error).

`columns` renames columns before the checks (`{"question": "prompt"}`), so a
dataset whose columns have other names needs no conversion step. Rows then
go through the same checks as JSONL lines (`rollout.data.formats`, all of
TRL's shapes), and a bad row is located as `{path}[{split}]:row {index}`
with the 0-based index `dataset[index]` would read.

`streaming=True` reads the files row by row (`load_dataset(..., streaming=True)`)
instead of first converting them into `datasets`' Arrow cache; the valid rows
are still kept in memory, since training shuffles them every epoch. With
streaming, `datasets` imports torch when it is installed (its
IterableDataset shares an epoch counter with torch workers).

`datasets` is imported only when one of these functions runs (the `data`
extra: `pip install "rollout[data]"`), with its progress bars and log lines
off so the CLI's stderr stays one `error: ...` line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from rollout.data.formats import LineKind
from rollout.data.jsonl import DataReport, Item, OnBadLine, Row, collect_rows
from rollout.errors import DataError

FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
"""File suffix -> the `datasets` packaged builder that reads it."""


def read_hf_rows(
    kind: LineKind,
    *,
    path: Path | None = None,
    name: str | None = None,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    streaming: bool = False,
    on_bad_line: OnBadLine = "error",
) -> tuple[list[Row], DataReport]:
    """Load one split, check every row, and return the valid rows and a report (see `read_rows`)."""
    rows: list[Row] = []
    report = _scan(kind, path, name, split, dict(columns or {}), streaming, on_bad_line, rows.append)
    return rows, report


def scan_hf_dataset(
    kind: LineKind,
    *,
    path: Path | None = None,
    name: str | None = None,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    streaming: bool = False,
    on_bad_line: OnBadLine = "error",
) -> DataReport:
    """The checks of `read_hf_rows` without keeping the rows (for `validate` / `plan`)."""
    return _scan(kind, path, name, split, dict(columns or {}), streaming, on_bad_line, None)


def hf_source_label(path: Path | None, name: str | None, split: str) -> str:
    """How messages name a split: `data/train.parquet[train]`, `org/name[test]`."""
    return f"{path if path is not None else name}[{split}]"


def check_hf_source_exists(path: Path | None, name: str | None) -> None:
    """A local source must exist (cheap: no `datasets` import); a hub id is checked when loaded."""
    _check_one_source(path, name)
    if path is not None and not path.exists():
        raise DataError(f"dataset not found: {path}")


# --- loading ----------------------------------------------------------------------


def _scan(
    kind: LineKind,
    path: Path | None,
    name: str | None,
    split: str,
    columns: dict[str, str],
    streaming: bool,
    on_bad_line: OnBadLine,
    keep: Callable[[Row], None] | None,
) -> DataReport:
    check_hf_source_exists(path, name)
    label = hf_source_label(path, name, split)
    datasets = _import_datasets()
    with _quiet(datasets):
        dataset = _load_split(datasets, path, name, split, streaming, label)
        items = _items(dataset, columns, label)
        return collect_rows(
            _reading(items, label), kind, on_bad_line=on_bad_line, keep=keep, path=path, source=label
        )


def _check_one_source(path: Path | None, name: str | None) -> None:
    if (path is None) == (name is None):
        raise DataError("an hf_dataset needs exactly one of path (local files) and name (a hub id)")


def _import_datasets() -> ModuleType:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            'kind = "hf_dataset" needs the `datasets` library: pip install "rollout[data]"'
        ) from exc
    return datasets


@contextmanager
def _quiet(datasets: ModuleType) -> Iterator[None]:
    """No progress bars or log lines from `datasets` while it loads (our errors say what failed)."""
    bars_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_on:
            datasets.enable_progress_bars()


def _load_split(
    datasets: ModuleType, path: Path | None, name: str | None, split: str, streaming: bool, label: str
) -> Any:
    """A `Dataset` or `IterableDataset` of one split."""
    try:
        if name is not None:
            return datasets.load_dataset(name, split=split, streaming=streaming)
        assert path is not None
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            return _split_of_saved(datasets.load_from_disk(str(path)), split, label)
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split, streaming=streaming)
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"{path}: can't tell the file type from {path.suffix or 'a missing suffix'!r}:"
                f" hf_dataset reads {', '.join(FILE_BUILDERS)} files and dataset folders"
            )
        return datasets.load_dataset(builder, data_files=str(path), split=split, streaming=streaming)
    except DataError:
        raise
    except ValueError as exc:
        if "Unknown split" in str(exc):
            raise DataError(f"{label}: no split {split!r}: {exc}") from exc
        raise DataError(f"{label}: can't read the dataset: {_why(exc)}") from exc
    except ConnectionError as exc:  # before OSError, of which it is a kind
        raise DataError(f"{label}: can't load hub dataset {name!r} (offline, or no such dataset): {exc}") from exc
    except (OSError, datasets.exceptions.DatasetsError) as exc:
        raise DataError(f"{label}: can't read the dataset: {_why(exc)}") from exc


def _split_of_saved(saved: Any, split: str, label: str) -> Any:
    """A `save_to_disk` folder holds a Dataset (any split name refers to it) or a DatasetDict."""
    if not hasattr(saved, "keys"):
        return saved
    if split not in saved:
        raise DataError(f"{label}: no split {split!r}; the saved DatasetDict has {', '.join(saved.keys())}")
    return saved[split]


def _why(exc: BaseException) -> str:
    """The exception's message and, for `datasets`' generic wrappers, its cause."""
    cause = exc.__cause__
    return f"{exc} ({type(cause).__name__}: {cause})" if cause is not None else str(exc)


def _items(dataset: Any, columns: dict[str, str], label: str) -> Iterator[Item]:
    """(row index, location, the row with `columns` renamed, None) for every row of the split."""
    names = dataset.column_names
    if names is not None:
        _check_columns(columns, list(names), label)
    for index, example in enumerate(dataset):
        if index == 0 and names is None:
            _check_columns(columns, list(example), label)
        data = {columns.get(k, k): v for k, v in example.items()} if columns else example
        yield index, f"{label}:row {index}", data, None


def _check_columns(columns: dict[str, str], names: list[str], label: str) -> None:
    for source, target in columns.items():
        if source not in names:
            raise DataError(f'{label}: columns maps "{source}", which the dataset lacks (it has {", ".join(names)})')
        if target in names and target not in columns:
            raise DataError(
                f'{label}: columns maps "{source}" to "{target}", but the dataset already has a "{target}" column'
            )
    targets = list(columns.values())
    for target in targets:
        if targets.count(target) > 1:
            raise DataError(f'{label}: columns maps several columns to "{target}"')


def _reading(items: Iterator[Item], label: str) -> Iterator[Item]:
    """`items`, with a read failure partway through (a corrupt row group, a dropped connection) located."""
    try:
        yield from items
    except DataError:
        raise
    except (OSError, ValueError) as exc:
        raise DataError(f"{label}: can't read the dataset: {_why(exc)}") from exc
