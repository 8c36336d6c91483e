"""`kind = "hf_dataset"` (files through the `datasets` library) and `kind = "mixture"`.

Parquet files are written with `datasets` itself; `datasets`' Arrow cache goes
to the test's tmp folder. Training from parquet must give exactly the losses
of the same rows as JSONL; bad rows are located as `{path}[{split}]:row {i}`.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/data/test_hf_dataset.py -q
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from train_helpers import A, U, make_tiny_model, run_cli, train_tiny, write_config, write_jsonl

from rollout.data.hf import read_hf_rows
from rollout.data.jsonl import Row
from rollout.data.mixture import interleave_rows
from rollout.data.sources import read_dataset, scan_dataset_source
from rollout.errors import DataError

datasets = pytest.importorskip("datasets")

SUMS = [(a, b) for a in range(4) for b in range(4)]
CHATS = [{"prompt": [U(f"{a}+{b}=")], "completion": [A(str(a + b))]} for a, b in SUMS]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """`datasets` writes its Arrow cache under the test's tmp folder, not ~/.cache."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def hf(path: Path, **more) -> dict:
    return {"kind": "hf_dataset", "path": str(path), **more}


def test_sft_from_parquet_with_renamed_columns_trains_as_from_jsonl(tiny_model, tmp_path):
    parquet = write_parquet(tmp_path / "chats.parquet", [{"question": r["prompt"], "answer": r["completion"]}
                                                          for r in CHATS])
    jsonl = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    columns = {"question": "prompt", "answer": "completion"}
    (result, losses), (_, expected) = (
        train_tiny("sft", tmp_path / "pq", tiny_model, hf(parquet, columns=columns), steps=3,
                   loss_on={"kind": "completion"}),
        train_tiny("sft", tmp_path / "js", tiny_model, {"kind": "jsonl_path", "path": str(jsonl)}, steps=3,
                   loss_on={"kind": "completion"}),
    )
    assert result.steps == 3 and len(losses) == 3
    assert losses == expected


def test_rows_and_their_locations(tmp_path):
    parquet = write_parquet(tmp_path / "pairs.parquet", [
        {"chosen": [U("1+1="), A("2")], "rejected": [U("1+1="), A("3")]},  # TRL's implicit prompt
        {"chosen": [U("2+2="), A("4")], "rejected": [U("2+2="), A("5")]},
    ])
    rows, report = read_hf_rows("preference", path=parquet)
    assert rows == [
        Row(line=0, data={"prompt": [U("1+1=")], "chosen": [A("2")], "rejected": [A("3")]}),
        Row(line=1, data={"prompt": [U("2+2=")], "chosen": [A("4")], "rejected": [A("5")]}),
    ]
    assert [r.location for r in rows] == [f"{parquet}[train]:row 0", f"{parquet}[train]:row 1"]
    assert (report.num_lines, report.num_valid, report.num_skipped, report.label) == (2, 2, 0, f"{parquet}[train]")
    streamed, _ = read_hf_rows("preference", path=parquet, streaming=True)
    assert streamed == rows


def test_bad_row_is_located_by_index(tmp_path):
    lines = [dict(r) for r in CHATS]
    lines[13] = {"prompt": [U("3+1=")], "completion": [U("4")]}
    parquet = write_parquet(tmp_path / "chats.parquet", lines)
    with pytest.raises(DataError) as info:
        read_hf_rows("sft", path=parquet)
    assert str(info.value) == f'{parquet}[train]:row 13: field "completion" has no assistant message'
    rows, report = read_hf_rows("sft", path=parquet, on_bad_line="skip")
    assert len(rows) == 15 and 13 not in [r.line for r in rows]
    assert report.num_skipped == 1 and report.errors == (str(info.value),)


def test_cli_validate_locates_a_bad_parquet_row_and_a_missing_file(tiny_model, tmp_path):
    lines = [dict(r) for r in CHATS]
    lines[5] = {"prompt": [U("2+2=")], "completion": [U("no")]}
    parquet = write_parquet(tmp_path / "chats.parquet", lines)
    config = write_config(tmp_path, "sft", tiny_model, hf(parquet))
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    out = run_cli("validate", "--config", config, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[0] == f'error: {parquet}[train]:row 5: field "completion" has no assistant message'
    assert "Traceback" not in out.stderr

    missing = tmp_path / "nope.parquet"
    config = write_config(tmp_path, "sft", tiny_model, hf(missing))
    line = next(n for n, text in enumerate(config.read_text().splitlines(), 1) if text.startswith("dataset = "))
    for command in (("validate",), ("train", "sft", "--dry-run")):
        out = run_cli(*command, "--config", config, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines() == [
            f"error: {config}:{line}: algorithm.sft.dataset.path: dataset not found: {missing}"
        ]


def test_saved_dataset_folder_and_its_splits(tmp_path):
    train = datasets.Dataset.from_list(CHATS[:10])
    test = datasets.Dataset.from_list(CHATS[10:])
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    rows, _ = read_hf_rows("sft", path=folder, split="test")
    assert [r.data for r in rows] == CHATS[10:]
    with pytest.raises(DataError, match=r"\[validation\]: no split 'validation'; the saved DatasetDict has train, test$"):
        read_hf_rows("sft", path=folder, split="validation")
    one = tmp_path / "one"
    train.save_to_disk(str(one))
    assert [r.data for r in read_hf_rows("sft", path=one)[0]] == CHATS[:10]


def test_json_lines_and_folder_of_split_files(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"q": f"{a}+{b}=", "answer": str(a + b)} for a, b in SUMS])
    rows, _ = read_hf_rows("prompt", path=jsonl, columns={"q": "prompt"})
    assert rows[0].data == {"prompt": "0+0=", "answer": "0"} and len(rows) == 16
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    write_parquet(folder / "train-00000-of-00001.parquet", CHATS[:12])
    write_parquet(folder / "test-00000-of-00001.parquet", CHATS[12:])
    rows, _ = read_hf_rows("sft", path=tmp_path / "repo", split="test")
    assert [r.data for r in rows] == CHATS[12:]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"question": "prompt"}, 'columns maps "question", which the dataset lacks (it has prompt, completion)'),
        ({"completion": "prompt"}, 'columns maps "completion" to "prompt", but the dataset already has a "prompt" column'),
    ],
)
def test_bad_column_maps(columns, message, tmp_path):
    parquet = write_parquet(tmp_path / "chats.parquet", CHATS)
    with pytest.raises(DataError) as info:
        read_hf_rows("sft", path=parquet, columns=columns)
    assert str(info.value) == f"{parquet}[train]: {message}"


def test_unreadable_sources_are_clear_errors(tmp_path):
    garbage = tmp_path / "bad.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet\[train\]: can't read the dataset: .*magic bytes"):
        read_hf_rows("sft", path=garbage)
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    with pytest.raises(DataError, match=r"data\.txt: can't tell the file type from '\.txt'"):
        read_hf_rows("sft", path=odd)
    parquet = write_parquet(tmp_path / "chats.parquet", CHATS)
    with pytest.raises(DataError, match=r"\[test\]: no split 'test'"):
        read_hf_rows("sft", path=parquet, split="test")


def test_hub_dataset_offline_is_a_clear_error(tiny_model, tmp_path):
    config = write_config(tmp_path, "sft", tiny_model, {"kind": "hf_dataset", "name": "org/some-dataset"})
    out = run_cli("validate", "--config", config, env={"HF_DATASETS_CACHE": str(tmp_path / "hf-cache")})
    assert out.returncode == 2, out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith("error: org/some-dataset[train]: can't load hub dataset 'org/some-dataset'"), first
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- mixtures


def test_interleave_is_seeded_weighted_and_stops_as_asked():
    big, small = [("big", i) for i in range(300)], [("small", i) for i in range(100)]
    mixed = interleave_rows([big, small], [3.0, 1.0], seed=0, stop="first_exhausted")
    assert mixed == interleave_rows([big, small], [3.0, 1.0], seed=0, stop="first_exhausted")
    assert mixed != interleave_rows([big, small], [3.0, 1.0], seed=1, stop="first_exhausted")
    counts = Counter(name for name, _ in mixed)
    assert counts["big"] == 300 or counts["small"] == 100  # stopped when the first source ran out
    assert 2.4 < counts["big"] / counts["small"] < 3.6
    assert [i for name, i in mixed if name == "big"] == list(range(counts["big"]))  # each source in file order

    everything = interleave_rows([big, small[:10]], [1.0, 1.0], seed=0, stop="all_exhausted")
    counts = Counter(name for name, _ in everything)
    assert counts["big"] == 300 and counts["small"] > 200  # the small source repeated until the big one ran out
    assert {i for name, i in everything if name == "small"} == set(range(10))
    with pytest.raises(DataError, match="would repeat its sources about"):
        interleave_rows([big, small[:1]], [1.0, 1000.0], seed=0, stop="all_exhausted")


def mixture(*sources: dict, seed: int = 0, stop: str = "first_exhausted") -> dict:
    return {"kind": "mixture", "seed": seed, "stop": stop, "sources": list(sources)}


def test_mixture_of_jsonl_and_parquet_trains_and_resumes_exactly(tiny_model, tmp_path):
    from rollout.config import load_config
    from rollout.store import open_store

    sums = write_jsonl(tmp_path / "sums.jsonl", CHATS)
    diffs = write_parquet(tmp_path / "diffs.parquet", [
        {"q": [U(f"{a}-{b}=")], "a": [A(str(a - b))]} for a in range(4) for b in range(a + 1)
    ])
    data = mixture(
        {"kind": "jsonl_path", "path": str(sums), "weight": 2.0},
        hf(diffs, columns={"q": "prompt", "a": "completion"}, weight=1.0),
        seed=3, stop="all_exhausted",
    )
    config = write_config(tmp_path / "run", "sft", tiny_model, data, steps=4, snapshot={"every_steps": 2})
    cfg = load_config(config)
    rows, report = read_dataset(cfg.algorithm.settings.dataset, "sft")
    assert report.num_valid == 26 and report.label.startswith(f"mixture({sums} x2, {diffs}[train] x1)")
    assert {r.location.split(":")[0] for r in rows} == {str(sums), f"{diffs}[train]"}
    assert rows == read_dataset(cfg.algorithm.settings.dataset, "sft")[0]
    assert scan_dataset_source(cfg.algorithm.settings.dataset, "sft") == report

    from rollout.algorithms.sft import train_sft

    first = train_sft(cfg)
    store = open_store("embedded", path=tmp_path / "run" / "store" / "rollout.db")
    try:
        losses = {m.step: m.value for m in store.read_metrics(first.run_id, name="train/loss")}
        middle = next(s for s in store.list_snapshots(run_id=first.run_id, kind="train_state") if s.step == 2)
        resumed = train_sft(cfg, resume=middle.id)
        again = {m.step: m.value for m in store.read_metrics(resumed.run_id, name="train/loss")}
    finally:
        store.close()
    assert sorted(losses) == [1, 2, 3, 4]
    assert {step: again[step] for step in (3, 4)} == {step: losses[step] for step in (3, 4)}
