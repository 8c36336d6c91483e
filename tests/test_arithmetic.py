"""The arithmetic task: problems, dataset files, answer extraction and greedy accuracy.

Run:

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/test_arithmetic.py -q
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.errors import ConfigError
from rollout.tasks.arithmetic import (
    OPS,
    extract_answer,
    greedy_accuracy,
    is_correct,
    make_problem,
    write_arithmetic_dataset,
)

FILES = ("sft", "pref", "prompts", "kto", "rm_pref", "eval_sft", "eval_pref", "eval_prompts", "eval_kto", "eval_rm_pref")
QUESTION = re.compile(r"What is (\d+)([+\-*])(\d+)\?")


def _solve(question: str) -> int:
    match = QUESTION.fullmatch(question)
    assert match is not None, question
    left, op, right = int(match.group(1)), match.group(2), int(match.group(3))
    return {"+": left + right, "-": left - right, "*": left * right}[op]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("op", OPS)
def test_make_problem_answers_are_right(op: str) -> None:
    rng = random.Random(0)
    for _ in range(300):
        question, answer = make_problem(rng, min_operand=0, max_operand=30, ops=[op])
        assert f"{op}" in question
        assert answer == str(_solve(question))


def test_make_problem_is_deterministic_and_uses_all_ops() -> None:
    draw = [make_problem(random.Random(7), min_operand=0, max_operand=9, ops=OPS) for _ in range(2)]
    assert draw[0] == draw[1]
    rng = random.Random(1)
    seen = {
        QUESTION.fullmatch(make_problem(rng, min_operand=2, max_operand=5, ops=OPS)[0]).group(2)
        for _ in range(100)
    }
    assert seen == set(OPS)
    rng = random.Random(2)
    operands = [
        int(x)
        for _ in range(200)
        for x in re.findall(r"\d+", make_problem(rng, min_operand=2, max_operand=5, ops="+")[0])
    ]
    assert min(operands) == 2 and max(operands) == 5


def test_dataset_files_shapes_and_format(tmp_path: Path) -> None:
    written = write_arithmetic_dataset(tmp_path, num_train=50, num_eval=20, ops=OPS, max_operand=12)
    assert list(written) == list(FILES)
    for name, path in written.items():
        raw = path.read_bytes()
        assert raw.endswith(b"\n") and b"\r" not in raw
        assert len(raw.splitlines()) == (20 if name.startswith("eval_") else 50)
    for prefix in ("", "eval_"):
        sft, pref, prompts = (_read(written[prefix + kind]) for kind in ("sft", "pref", "prompts"))
        for s, p, q in zip(sft, pref, prompts, strict=True):
            user, assistant = s["messages"]
            assert set(s) == {"messages"} and user["role"] == "user" and assistant["role"] == "assistant"
            assert assistant["content"] == str(_solve(user["content"]))
            assert set(p) == {"prompt", "chosen", "rejected"}
            assert p["prompt"] == [user] and p["chosen"] == [assistant]
            assert p["rejected"][0]["role"] == "assistant"
            assert q == {"prompt": [user], "answer": assistant["content"]}
        rm_pref = _read(written[prefix + "rm_pref"])
        for i, (p, r) in enumerate(zip(pref, rm_pref, strict=True)):  # every tenth rejects a non-answer
            rejected = [{"role": "assistant", "content": ""}] if i % 10 == 9 else p["rejected"]
            assert r == {**p, "rejected": rejected}


def test_dataset_is_deterministic_and_seed_dependent(tmp_path: Path) -> None:
    kwargs = {"num_train": 100, "num_eval": 30, "ops": ("+", "*")}
    a = write_arithmetic_dataset(tmp_path / "a", seed=3, **kwargs)
    b = write_arithmetic_dataset(tmp_path / "b", seed=3, **kwargs)
    c = write_arithmetic_dataset(tmp_path / "c", seed=4, **kwargs)
    for name in FILES:
        assert a[name].read_bytes() == b[name].read_bytes()
    assert a["sft"].read_bytes() != c["sft"].read_bytes()


def test_kto_lines_alternate_right_and_wrong_answers_of_the_same_problems(tmp_path: Path) -> None:
    written = write_arithmetic_dataset(tmp_path, num_train=40, num_eval=10)
    for split in ("", "eval_"):
        kto, pref = _read(written[f"{split}kto"]), _read(written[f"{split}pref"])
        assert len(kto) == len(pref)
        for i, (k, p) in enumerate(zip(kto, pref, strict=True)):
            assert k["prompt"] == p["prompt"] and k["label"] is (i % 2 == 0)
            assert k["completion"] == (p["chosen"] if k["label"] else p["rejected"])


def test_eval_stream_is_independent_of_train(tmp_path: Path) -> None:
    written = write_arithmetic_dataset(tmp_path, num_train=200, num_eval=200, max_operand=50)
    train, evals = _read(written["prompts"]), _read(written["eval_prompts"])
    assert train != evals
    # more training lines don't change the eval lines (a separate stream, not a tail of the train draw)
    bigger = write_arithmetic_dataset(tmp_path / "bigger", num_train=500, num_eval=200, max_operand=50)
    assert bigger["eval_prompts"].read_bytes() == written["eval_prompts"].read_bytes()


@pytest.mark.parametrize(
    ("ops", "max_operand"), [(("+",), 9), (("-",), 9), (("*",), 9), (OPS, 3), (("+",), 0)]
)
def test_rejected_is_wrong_and_plausible(tmp_path: Path, ops: tuple[str, ...], max_operand: int) -> None:
    written = write_arithmetic_dataset(tmp_path, num_train=400, num_eval=50, ops=ops, max_operand=max_operand)
    near = 0
    for row in _read(written["pref"]) + _read(written["eval_pref"]):
        chosen, rejected = int(row["chosen"][0]["content"]), int(row["rejected"][0]["content"])
        assert rejected != chosen
        if "-" not in row["prompt"][0]["content"]:
            assert rejected >= 0
        near += abs(rejected - chosen) <= 3
    if max_operand == 9:
        assert 0.4 * 450 < near < 0.95 * 450  # both near misses and far values occur


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_operand": 5, "max_operand": 2}, "must be <= max_operand"),
        ({"min_operand": -1}, "must be >= 0"),
        ({"ops": ("/",)}, "unknown arithmetic op"),
        ({"ops": ()}, "at least one"),
        ({"num_train": 0}, "num_train must be >= 1"),
        ({"num_eval": 0}, "num_eval must be >= 1"),
    ],
)
def test_bad_arguments_raise(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        write_arithmetic_dataset(tmp_path / "d", **kwargs)
    with pytest.raises(ConfigError):
        make_problem(random.Random(0), min_operand=3, max_operand=1, ops="+")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("11", "11"),
        (" 11<|im_end|>", "11"),
        ("-3", "-3"),
        ("The answer is 42.", "42"),
        ("3+8=11", "3"),
        ("007", "7"),
        ("- 3", "3"),
        ("-0", "0"),
        ("12\n13", "12"),
        ("", None),
        ("no digits here", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("11", "11", True),
        (" 11 ", "11", True),
        ("11<|im_end|>", " 11\n", True),
        ("011", "11", True),
        ("-3", "-3", True),
        ("3", "-3", False),
        ("12", "11", False),
        ("", "11", False),
        ("eleven", "11", False),
    ],
)
def test_is_correct(completion: str, answer: str, expected: bool) -> None:
    assert is_correct(completion, answer) is expected


# --- greedy_accuracy ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rollout.models.tiny import init_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path
    ), transformers.AutoTokenizer.from_pretrained(path)


class _OracleModel:
    """Stands in for a causal LM: `generate` appends the right (or a wrong) answer and <|im_end|>."""

    def __init__(self, tokenizer, *, wrong: bool = False) -> None:
        self.tokenizer, self.wrong, self.calls = tokenizer, wrong, 0

    def generate(self, input_ids, attention_mask, *, do_sample, max_new_tokens, eos_token_id, pad_token_id):
        import torch

        assert do_sample is False and eos_token_id == self.tokenizer.eos_token_id
        assert (attention_mask[:, -1] == 1).all()  # left padded
        self.calls += 1
        new_rows = []
        for row in input_ids.tolist():
            question = re.findall(r"What is \d+[+\-*]\d+\?", self.tokenizer.decode(row))[-1]
            answer = _solve(question) + (1 if self.wrong else 0)
            new_rows.append(self.tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"])
        width = max(map(len, new_rows))
        padded = [r + [pad_token_id] * (width - len(r)) for r in new_rows]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)


def test_greedy_accuracy_with_an_oracle(tmp_path: Path, tiny) -> None:
    _, tokenizer = tiny
    written = write_arithmetic_dataset(tmp_path, num_train=10, num_eval=37, ops=OPS, max_operand=20)
    rows = _read(written["eval_prompts"])
    oracle = _OracleModel(tokenizer)
    assert greedy_accuracy(oracle, tokenizer, rows, batch_size=8) == 1.0
    assert oracle.calls == 5
    assert tokenizer.padding_side == "right"  # restored
    assert greedy_accuracy(_OracleModel(tokenizer, wrong=True), tokenizer, rows) == 0.0


def test_greedy_accuracy_with_the_tiny_random_model(tmp_path: Path, tiny) -> None:
    model, tokenizer = tiny
    written = write_arithmetic_dataset(tmp_path, num_train=10, num_eval=24)
    accuracy = greedy_accuracy(
        model, tokenizer, _read(written["eval_prompts"]), batch_size=16, max_new_tokens=4
    )
    assert 0.0 <= accuracy <= 1.0
    assert tokenizer.padding_side == "right"


def test_cli_data_arithmetic(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("rollout")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "rollout.cli.main"]
    out = tmp_path / "data"
    done = subprocess.run(
        [*command, "data", "arithmetic", str(out), "--num-train", "30", "--num-eval", "5", "--ops=-*", "--seed", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for name in FILES:
        assert str(out / f"{name}.jsonl") in done.stdout
    assert len(_read(out / "sft.jsonl")) == 30 and len(_read(out / "eval_prompts.jsonl")) == 5
    direct = write_arithmetic_dataset(tmp_path / "direct", num_train=30, num_eval=5, ops=("-", "*"), seed=2)
    assert direct["pref"].read_bytes() == (out / "pref.jsonl").read_bytes()

    bad = subprocess.run(
        [*command, "data", "arithmetic", str(out), "--ops", "/"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown arithmetic op" in bad.stderr
