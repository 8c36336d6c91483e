"""TRL's dataset shapes are accepted unchanged: exact conversion to our rows, located errors, real runs.

The shapes are those of https://huggingface.co/docs/trl/dataset_formats (standard
and conversational forms of language modeling, prompt-only, prompt-completion,
preference with explicit and implicit prompt, unpaired preference). The
implicit-prompt splits below are the outputs of TRL 1.16's
`trl.data_utils.extract_prompt` on the same inputs (computed once; importing trl
here would cost ~20 s), so a difference from TRL fails the table test.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/data/test_trl_formats.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import A, U, make_tiny_model, run_cli, train_tiny, write_config, write_jsonl

from rollout.data.formats import extract_prompt
from rollout.data.jsonl import Row, read_rows
from rollout.errors import DataError


def S(content: str) -> dict[str, str]:
    return {"role": "system", "content": content}


SKY_U = U("What color is the sky?")
BLUE, GREEN = A("It is blue."), A("It is green.")

# (kind, line in TRL's shape, the rows we train on)
SHAPES = {
    "standard language modeling": ("sft", {"text": "The sky is blue."}, [{"text": "The sky is blue."}]),
    "conversational language modeling": ("sft", {"messages": [SKY_U, BLUE]}, [{"messages": [SKY_U, BLUE]}]),
    "standard prompt-only": ("prompt", {"prompt": "The sky is"}, [{"prompt": "The sky is"}]),
    "conversational prompt-only": ("prompt", {"prompt": [SKY_U]}, [{"prompt": [SKY_U]}]),
    "standard prompt-completion": (
        "sft", {"prompt": "The sky is", "completion": " blue."}, [{"prompt": "The sky is", "completion": " blue."}],
    ),
    "conversational prompt-completion": (
        "sft", {"prompt": [SKY_U], "completion": [BLUE]}, [{"prompt": [SKY_U], "completion": [BLUE]}],
    ),
    "standard preference": (
        "preference",
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
    ),
    "conversational preference": (
        "preference",
        {"prompt": [SKY_U], "chosen": [BLUE], "rejected": [GREEN]},
        [{"prompt": [SKY_U], "chosen": [BLUE], "rejected": [GREEN]}],
    ),
    "standard implicit-prompt preference": (
        "preference",
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
    ),
    "conversational implicit-prompt preference": (
        "preference",
        {"chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN]},
        [{"prompt": [SKY_U], "chosen": [BLUE], "rejected": [GREEN]}],
    ),
    "implicit prompt keeps other fields": (
        "preference",
        {"chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN], "margin": 0.5},
        [{"prompt": [SKY_U], "chosen": [BLUE], "rejected": [GREEN], "margin": 0.5}],
    ),
    "string prompt beside full conversations (maybe_extract_prompt)": (
        "preference",
        {"prompt": "What color is the sky?", "chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN]},
        [{"prompt": [SKY_U], "chosen": [BLUE], "rejected": [GREEN]}],
    ),
    "standard unpaired preference": (
        "kto",
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        [{"prompt": "The sky is", "completion": " blue.", "label": True}],
    ),
    "conversational unpaired preference": (
        "kto",
        {"prompt": [SKY_U], "completion": [GREEN], "label": False},
        [{"prompt": [SKY_U], "completion": [GREEN], "label": False}],
    ),
    "standard preference read for kto (unpaired as TRL's KTOTrainer does)": (
        "kto",
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": 7},
        [
            {"prompt": "The sky is", "completion": " blue.", "label": True, "id": 7},
            {"prompt": "The sky is", "completion": " green.", "label": False, "id": 7},
        ],
    ),
    "conversational implicit-prompt preference read for kto": (
        "kto",
        {"chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN]},
        [
            {"prompt": [SKY_U], "completion": [BLUE], "label": True},
            {"prompt": [SKY_U], "completion": [GREEN], "label": False},
        ],
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_trl_shape_becomes_our_rows(shape, tmp_path):
    kind, line, expected = SHAPES[shape]
    path = write_jsonl(tmp_path / "data.jsonl", [line, line])
    rows, report = read_rows(path, kind)
    assert rows == [Row(line=n, data=d) for n in (1, 2) for d in expected]
    assert [r.location for r in rows] == [f"{path}:{n}" for n in (1, 2) for _ in expected]
    assert (report.num_lines, report.num_valid, report.num_skipped) == (2, 2, 0)


# chosen, rejected, and TRL 1.16 extract_prompt's {"prompt", "chosen", "rejected"} for them
TRL_SPLITS = [
    ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
    ("2+2= 4", "2+2= 5", ("2+2=", " 4", " 5")),  # the space before the difference goes to the answers
    ("Q: x\nA: yes", "Q: x\nA: no", ("Q: x\nA:", " yes", " no")),
    ("ab", "ac", ("a", "b", "c")),
    ("The sky is blue", "The sky is blue.", ("The sky is blu", "e", "e.")),  # one is a prefix of the other
    ([SKY_U, BLUE], [SKY_U, GREEN], ([SKY_U], [BLUE], [GREEN])),
    (
        [S("s"), U("u1"), A("a1"), U("u2"), A("a2")],
        [S("s"), U("u1"), A("a1"), U("u2"), A("b2")],
        ([S("s"), U("u1"), A("a1"), U("u2")], [A("a2")], [A("b2")]),
    ),
    ([U("u"), A("a")], [U("u"), A("a"), U("u2"), A("a2")], ([U("u")], [A("a")], [A("a"), U("u2"), A("a2")])),
]


@pytest.mark.parametrize(("chosen", "rejected", "expected"), TRL_SPLITS)
def test_implicit_prompt_splits_as_trl_does(chosen, rejected, expected):
    assert extract_prompt(chosen, rejected) == expected


BAD_LINES = [
    ({"chosen": "blue", "rejected": "green"}, "preference",
     'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'),
    ({"chosen": " a", "rejected": " b"}, "preference",  # the shared space moves to the answers: nothing is left
     'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'),
    ({"chosen": [SKY_U, BLUE], "rejected": [SKY_U, BLUE]}, "preference", "chosen and rejected are identical"),
    ({"chosen": "The sky", "rejected": [SKY_U, BLUE]}, "preference",
     'fields "chosen" and "rejected" must all be strings or all be lists of messages'),
    ({"chosen": [S("a"), SKY_U, BLUE], "rejected": [S("b"), SKY_U, BLUE]}, "preference",
     'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'),
    ({"chosen": [S("s"), U("x"), BLUE], "rejected": [S("s"), U("y"), BLUE]}, "preference",
     'implicit prompt: chosen and rejected share messages 0..0, but chosen[1] is a "user" turn;'
     " the shared prefix must end right before an assistant turn"),
    ({"chosen": [SKY_U, BLUE], "rejected": [SKY_U, BLUE, U("more?")]}, "preference",
     'implicit prompt: the last message of "rejected" must be an assistant turn, got "user"'),
    ({"chosen": [SKY_U], "rejected": [SKY_U, GREEN]}, "preference", 'field "chosen" has no assistant message'),
    ({"chosen": [SKY_U, BLUE]}, "preference", 'missing field "rejected"'),
    ({"prompt": [SKY_U], "chosen": "c", "rejected": "r"}, "preference",
     'fields "prompt", "chosen" and "rejected" must all be strings or all be lists of messages'),
    ({"chosen": "blue", "rejected": "green"}, "kto",
     'no "prompt" field, and chosen and rejected share no prefix to take it from (the implicit prompt)'),
    ({"prompt": "p", "completion": "c", "label": 1}, "kto", 'field "label" must be a boolean, got number'),
]


@pytest.mark.parametrize(("bad", "kind", "problem"), BAD_LINES)
def test_bad_line_17_is_located(bad, kind, problem, tmp_path):
    good = {"chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN]}
    path = write_jsonl(tmp_path / "data.jsonl", [good] * 16 + [bad] + [good] * 3)
    with pytest.raises(DataError) as info:
        read_rows(path, kind)
    assert str(info.value) == f"{path}:17: {problem}"


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


SUMS = [(a, b) for a in range(4) for b in range(4)]


def test_sft_trains_on_conversational_prompt_completion(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": [U(f"{a}+{b}=")], "completion": [A(str(a + b))]}
                                               for a, b in SUMS])
    result, losses = train_tiny(
        "sft", tmp_path / "run", tiny_model, {"kind": "jsonl_path", "path": str(data)}, steps=3,
        loss_on={"kind": "completion"},
    )
    assert result.steps == 3 and len(losses) == 3
    assert all(0 < loss < 20 for loss in losses)


def test_dpo_on_implicit_prompt_pairs_trains_exactly_as_on_explicit_ones(tiny_model, tmp_path):
    """TRL's implicit-prompt conversations give the very same run as the pairs written out by hand."""
    implicit = write_jsonl(tmp_path / "implicit.jsonl", [
        {"chosen": [U(f"{a}+{b}="), A(str(a + b))], "rejected": [U(f"{a}+{b}="), A(str(a + b + 1))]}
        for a, b in SUMS
    ])
    explicit = write_jsonl(tmp_path / "explicit.jsonl", [
        {"prompt": [U(f"{a}+{b}=")], "chosen": [A(str(a + b))], "rejected": [A(str(a + b + 1))]} for a, b in SUMS
    ])
    runs = [
        train_tiny("dpo", tmp_path / name, tiny_model, {"kind": "jsonl_path", "path": str(path)}, steps=3)
        for name, path in (("implicit", implicit), ("explicit", explicit))
    ]
    (result, losses), (_, expected) = runs
    assert result.steps == 3 and len(losses) == 3
    assert losses == expected
    assert abs(losses[0] - 0.6931) < 1e-3  # step 1: policy == reference, so -log σ(0) = ln 2


def test_kto_on_paired_preference_trains_exactly_as_on_unpaired_lines(tiny_model, tmp_path):
    """TRL's KTOTrainer unpairs preference data; so do we, row for row."""
    paired = write_jsonl(tmp_path / "paired.jsonl", [
        {"prompt": [U(f"{a}+{b}=")], "chosen": [A(str(a + b))], "rejected": [A(str(a + b + 1))]} for a, b in SUMS
    ])
    unpaired_lines = []
    for a, b in SUMS:
        unpaired_lines.append({"prompt": [U(f"{a}+{b}=")], "completion": [A(str(a + b))], "label": True})
        unpaired_lines.append({"prompt": [U(f"{a}+{b}=")], "completion": [A(str(a + b + 1))], "label": False})
    unpaired = write_jsonl(tmp_path / "unpaired.jsonl", unpaired_lines)
    runs = [
        train_tiny("kto", tmp_path / name, tiny_model, {"kind": "jsonl_path", "path": str(path)}, steps=3)
        for name, path in (("paired", paired), ("unpaired", unpaired))
    ]
    (result, losses), (_, expected) = runs
    assert result.steps == 3 and len(losses) == 3
    assert losses == expected
    assert all(0 < loss < 2 for loss in losses)


def test_validate_locates_a_bad_implicit_prompt_line(tiny_model, tmp_path):
    good = {"chosen": [SKY_U, BLUE], "rejected": [SKY_U, GREEN]}
    data = write_jsonl(tmp_path / "pref.jsonl", [good] * 16 + [{"chosen": [SKY_U, BLUE], "rejected": [SKY_U, BLUE]}])
    config = write_config(tmp_path, "dpo", tiny_model, {"kind": "jsonl_path", "path": str(data)})
    out = run_cli("validate", "--config", config)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[0] == f"error: {data}:17: chosen and rejected are identical"
    assert "Traceback" not in out.stderr

    data.write_text("".join(json.dumps(good) + "\n" for _ in range(17)))
    out = run_cli("validate", "--config", config)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"dataset={data} lines=17")
