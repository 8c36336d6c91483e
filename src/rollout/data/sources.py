"""From a `[algorithm.<kind>.dataset]` block to checked rows: the one place that reads its kind.

    rows, report = read_dataset(s.dataset, "sft")     # training: every row checked, DataError located
    report = scan_dataset_source(s.dataset, "sft")     # validate / plan: the same checks
    check_dataset_exists(s.dataset)                    # dry-run: files exist, nothing is read
    dataset_label(s.dataset)                           # how messages name it

The kinds: `jsonl_path` (`rollout.data.jsonl`), `hf_dataset` (`rollout.data.hf`)
and `mixture` (each source read as above, then `rollout.data.mixture`'s
seeded interleave). Rows keep their own location (`file:17`,
`file[train]:row 16`), so later errors about a row name the right file in a
mixture too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.data.formats import LineKind
from rollout.data.hf import check_hf_source_exists, hf_source_label, read_hf_rows, scan_hf_dataset
from rollout.data.jsonl import MAX_REPORTED_ERRORS, DataReport, Row, read_rows, scan_dataset
from rollout.data.mixture import interleave_rows
from rollout.errors import DataError

if TYPE_CHECKING:
    from rollout.algorithms.config import HFDatasetConfig, JsonlDatasetConfig, MixtureDatasetConfig

    SourceConfig = JsonlDatasetConfig | HFDatasetConfig
    DatasetConfig = JsonlDatasetConfig | HFDatasetConfig | MixtureDatasetConfig


def read_dataset(config: DatasetConfig, kind: LineKind) -> tuple[list[Row], DataReport]:
    """The checked rows of the dataset block and a report (for a mixture: over all its sources)."""
    if config.kind != "mixture":
        return _read_source(config, kind)
    read = [_read_source(source, kind) for source in config.sources]
    rows = interleave_rows(
        [rows for rows, _ in read], [source.weight for source in config.sources], seed=config.seed, stop=config.stop
    )
    return rows, _mixture_report(config, [report for _, report in read])


def scan_dataset_source(config: DatasetConfig, kind: LineKind) -> DataReport:
    """The checks of `read_dataset`; a mixture's sources are scanned one by one."""
    if config.kind == "mixture":
        return _mixture_report(config, [_scan_source(source, kind) for source in config.sources])
    return _scan_source(config, kind)


def check_dataset_exists(config: DatasetConfig) -> None:
    """Every local file or folder the block names exists (`DataError: dataset not found: ...`)."""
    for source in config.sources if config.kind == "mixture" else (config,):
        if source.kind == "jsonl_path":
            if not source.path.is_file():
                raise DataError(f"dataset not found: {source.path}")
        else:
            check_hf_source_exists(source.path, source.name)


def dataset_label(config: DatasetConfig) -> str:
    """`data/sft.jsonl`, `data/train.parquet[train]`, `mixture(a.jsonl x3, b.parquet[train] x1)`."""
    if config.kind == "mixture":
        parts = [f"{_source_label(s)} x{s.weight:g}" for s in config.sources]
        return f"mixture({', '.join(parts)})"
    return _source_label(config)


def _source_label(config: SourceConfig) -> str:
    if config.kind == "jsonl_path":
        return str(config.path)
    return hf_source_label(config.path, config.name, config.split)


def _read_source(config: SourceConfig, kind: LineKind) -> tuple[list[Row], DataReport]:
    if config.kind == "jsonl_path":
        return read_rows(config.path, kind, on_bad_line=config.on_bad_line)
    return read_hf_rows(
        kind, path=config.path, name=config.name, split=config.split, columns=config.columns,
        streaming=config.streaming, on_bad_line=config.on_bad_line,
    )


def _scan_source(config: SourceConfig, kind: LineKind) -> DataReport:
    if config.kind == "jsonl_path":
        return scan_dataset(config.path, kind, on_bad_line=config.on_bad_line)
    return scan_hf_dataset(
        kind, path=config.path, name=config.name, split=config.split, columns=config.columns,
        streaming=config.streaming, on_bad_line=config.on_bad_line,
    )


def _mixture_report(config: MixtureDatasetConfig, reports: list[DataReport]) -> DataReport:
    return DataReport(
        path=None,
        num_lines=sum(r.num_lines for r in reports),
        num_valid=sum(r.num_valid for r in reports),
        num_skipped=sum(r.num_skipped for r in reports),
        errors=tuple(e for r in reports for e in r.errors)[:MAX_REPORTED_ERRORS],
        source=dataset_label(config),
    )
