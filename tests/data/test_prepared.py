"""`rollout train` reads and tokenises its dataset once: the plan's pass goes to the recipe.

    .venv/bin/pytest tests/data/test_prepared.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import A, U, make_tiny_model, write_config, write_jsonl

import rollout.data.prepared as prepared
import rollout.data.sources as sources
from rollout.algorithms.registry import ALGORITHMS
from rollout.cli.train import _train
from rollout.config import load_config
from rollout.plan import make_plan
from rollout.store import open_store

LINES = {
    "sft": [{"messages": [U(f"What is {i} + 1?"), A(str(i + 1))]} for i in range(12)],
    "kto": [{"prompt": f"{i} + 1 =", "completion": f" {i + 1 + i % 2}", "label": i % 2 == 0} for i in range(12)],
    "rm": [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(12)],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("prepared"))


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How often a dataset source is read and how often lines are tokenised, by anyone."""
    calls = {"read": 0, "encode": 0}

    def counting(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(sources, "_read_source", counting("read", sources._read_source))
    monkeypatch.setattr(prepared, "encode_sft", counting("encode", prepared.encode_sft))
    monkeypatch.setattr(prepared, "encode_pairs", counting("encode", prepared.encode_pairs))
    return calls


def losses(root: Path, run_id: str) -> list[float]:
    store = open_store("embedded", path=root / "store" / "rollout.db")
    try:
        return [m.value for m in store.read_metrics(run_id, name="train/loss")]
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sft", "kto", "rm"])
def test_train_reads_and_tokenises_once_and_trains_as_the_recipe_alone(kind, model, tmp_path, counted, capsys):
    dataset = {"kind": "jsonl_path", "path": str(write_jsonl(tmp_path / "data.jsonl", LINES[kind]))}
    settings = {"loss_on": {"kind": "assistant"}} if kind == "sft" else {}
    config = write_config(tmp_path / "planned", kind, model, dataset, steps=3, **settings)
    _train(kind, config, None, False)  # `rollout train <kind> --config F`: plan, then the recipe
    assert counted == {"read": 1, "encode": 1}
    planned_run = capsys.readouterr().out.split()[1]

    alone = write_config(tmp_path / "alone", kind, model, dataset, steps=3, **settings)
    result = ALGORITHMS[kind].load_train()(load_config(alone))  # the recipe alone reads and tokenises itself
    assert counted == {"read": 2, "encode": 2}
    planned = losses(tmp_path / "planned", planned_run)
    assert len(planned) == 3 and planned == losses(tmp_path / "alone", result.run_id)


def test_a_dataset_changed_after_the_plan_is_read_again(model, tmp_path, counted):
    path = write_jsonl(tmp_path / "data.jsonl", LINES["sft"])
    cfg_path = write_config(tmp_path, "sft", model, {"kind": "jsonl_path", "path": str(path)})
    cfg = load_config(cfg_path)
    s = cfg.algorithm.settings
    make_plan(cfg_path, config=cfg, pin=False, hand_off=True)
    assert counted == {"read": 1, "encode": 1}
    with path.open("a", encoding="utf-8") as f:
        f.write('{"text": "one more line"}\n')
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, report, encoded = prepared.read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on="full")
    assert len(rows) == len(encoded) == report.num_valid == 13  # read again: the handoff's key holds the file's size
    assert counted == {"read": 2, "encode": 2}


def test_the_plans_rows_are_taken_once_and_only_for_the_same_settings(model, tmp_path, counted):
    path = write_jsonl(tmp_path / "data.jsonl", LINES["sft"])
    cfg_path = write_config(tmp_path, "sft", model, {"kind": "jsonl_path", "path": str(path)})
    cfg = load_config(cfg_path)
    s = cfg.algorithm.settings
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    make_plan(cfg_path, config=cfg, pin=False, hand_off=True)
    rows, _, encoded = prepared.read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on="full")
    assert counted == {"read": 1, "encode": 1}  # the plan's (loss_on "full" is the config's default)
    assert all(all(mask) for _, mask in encoded)
    again, _, encoded_again = prepared.read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on="full")
    assert counted == {"read": 2, "encode": 2} and encoded_again == encoded and again is not rows

    make_plan(cfg_path, config=cfg, pin=False, hand_off=True)
    _, _, assistant = prepared.read_encoded(s.dataset, "sft", tokenizer, model=s.base_model, loss_on="assistant")
    assert counted == {"read": 4, "encode": 4}  # another loss_on: tokenised again, with its own mask
    assert [ids for ids, _ in assistant] == [ids for ids, _ in encoded]
    assert all(0 < sum(mask) < len(mask) for _, mask in assistant)
