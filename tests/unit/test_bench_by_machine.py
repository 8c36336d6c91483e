"""`benchmarks/by_machine.py`: `make bench`'s results grouped by kind of machine, each kind's latest
whole run and how many runs since a date met each target (written results files stand in for runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    import by_machine
    import run_all
finally:
    sys.path.remove(BENCHMARKS)  # its modules' names (generation, machine, ...) stay out of other tests' way

AVX512 = ["avx512f", "avx512_bf16", "avx2"]


def _results(folder: Path, name: str, *, date: str, model: str = "AMD EPYC", isa: list[str] | None = None,
             engine: float = 1.75, validate_s: float = 0.25, commit: str | None = None, only_sft: bool = False,
             machine_line: bool = True) -> None:
    """A results file as run_all.py writes it: every targeted ratio at 1 and 2 threads at 1.1x its
    target, except the engine's (`engine`) and the startup's `validate` (`validate_s`)."""
    rows: list[dict[str, Any]] = []
    for (job, ratio), target in run_all.TARGETS.items():
        if only_sft and not job.startswith("sft"):
            continue
        for threads in (1, 2):
            median = engine if job == "generation" else round(target * 1.1, 3)
            rows.append({"job": job, "threads": threads, "ratio": ratio, "median_ratio": median, "target": target,
                         "extra": {}})
    for learn in (r for r in rows if r["job"] == "grpo-learn"):  # seeds 0-2: rollout ahead on two, behind on one
        learn["extra"] = {"rollout": [{"reward_last": x} for x in (0.30, 0.20, 0.25)],
                          "trl": [{"reward_last": x} for x in (0.20, 0.25, 0.20)]}
    startup = {"--help": {"wall": [0.12, 0.13, 0.14]}, "validate": {"wall": [validate_s] * 3}}
    meta: dict[str, Any] = {"date": date, "commit": commit}
    if machine_line:
        meta["cpu"] = {"model": model, "isa": isa or AVX512}
    (folder / name).write_text(json.dumps({"meta": meta, "rows": rows, "startup": startup}))


def test_kinds_from_the_machine_line():
    assert by_machine.machine_kind({"cpu": {"model": "Intel(R) Xeon(R) Processor", "isa": [*AVX512, "amx_tile"]}}) \
        == "Intel Xeon, AMX"
    assert by_machine.machine_kind({"cpu": {"model": "AMD EPYC", "isa": AVX512}}) == "AMD EPYC, AVX-512"
    assert by_machine.machine_kind({"cpu": {"model": "AMD EPYC", "isa": ["avx2"]}}) == "AMD EPYC, AVX2"
    assert by_machine.machine_kind({"date": "2026-11-28 09:55"}) is None  # before machine.py's line


def test_each_kind_shows_its_latest_whole_run_and_marks_what_is_short(tmp_path):
    _results(tmp_path, "a.json", date="2026-12-04 10:00", engine=1.25, commit="aaa1111")
    _results(tmp_path, "b.json", date="2026-12-05 10:00", engine=1.80, validate_s=0.34, commit="bbb2222")
    _results(tmp_path, "c.json", date="2026-12-06 10:00", engine=1.10, only_sft=True)  # an --only subset
    _results(tmp_path, "d.json", date="2026-12-05 12:00", isa=["avx2"], engine=1.40)
    _results(tmp_path, "old.json", date="2026-11-28 10:00", machine_line=False)
    runs = by_machine.load_runs(tmp_path)
    assert [r["file"] for r in runs] == ["a.json", "b.json", "d.json", "c.json"]  # by date; old.json has no kind
    assert runs[-1]["verdicts"] is None  # the subset is not a whole run
    lines = by_machine.render(runs).splitlines()
    head = next(line for line in lines if line.startswith("| target |"))
    assert head == "| target | AMD EPYC, AVX-512: b.json (bbb2222) | AMD EPYC, AVX2: d.json |"

    def row(name: str) -> list[str]:
        line = next(line for line in lines if line.startswith(f"| {name} |"))
        return [cell.strip() for cell in line.strip("|").split("|")][1:]

    assert row("generation engine/generate >= 1.5") == ["1.80x / 1.80x", "1.40x* / 1.40x*"]
    assert row("dpo rollout/trl >= 1.5") == ["1.65x / 1.65x", "1.65x / 1.65x"]
    assert row("rollout validate < 0.3 s (median wall)") == ["0.340 s*", "0.250 s"]
    assert row("grpo-learn reward, rollout >= TRL (or a tie)")[0] == "yes (0.250 vs 0.217) / yes (0.250 vs 0.217)"


def test_since_counts_the_whole_runs_of_each_kind_that_met_each_target(tmp_path):
    _results(tmp_path, "a.json", date="2026-12-03 10:00", engine=1.25)  # before --since
    _results(tmp_path, "b.json", date="2026-12-04 10:00", engine=1.80)
    _results(tmp_path, "c.json", date="2026-12-05 10:00", engine=1.45, validate_s=0.34)
    _results(tmp_path, "d.json", date="2026-12-06 10:00", engine=1.20, only_sft=True)
    text = by_machine.render(by_machine.load_runs(tmp_path), since="2026-12-04")
    counts = text.split("that met each target")[1].splitlines()
    assert "| target | AMD EPYC, AVX-512 (2 runs) |" in counts
    assert "| generation engine/generate >= 1.5 | 1/2 / 1/2 |" in counts
    assert "| sft-padded rollout/bare >= 0.95 | 2/2 / 2/2 |" in counts
    assert "| rollout validate < 0.3 s (median wall) | 1/2 |" in counts


def test_a_file_that_is_not_results_is_one_clear_error(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    try:
        by_machine.load_runs(tmp_path)
    except SystemExit as exit_:
        assert str(exit_).startswith(f"{tmp_path / 'broken.json'}: not a results file")
    else:
        raise AssertionError("a broken results file was read")
