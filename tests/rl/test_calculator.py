"""The calculator task: data files, answer extraction, the tool-use env and `rollout data calculator`.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/rl/test_calculator.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollout.cli.main import main
from rollout.data.formats import check_line
from rollout.errors import ConfigError
from rollout.rl.calc import calculator
from rollout.rl.calculator_env import CalculatorEnv, score
from rollout.rl.tools import ToolCall, ToolStats, parse_tool_calls
from rollout.rl.types import Env
from rollout.tasks.arithmetic import Problem
from rollout.tasks.calculator import (
    answer_from_text,
    balance_answer_lengths,
    digits_range,
    is_correct,
    sft_trace,
    tool_call_text,
    write_calculator_data,
)

CALL = tool_call_text("123*45")
ROW = {"prompt": [{"role": "user", "content": "What is 123*45?"}], "answer": "5535"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def problem_of(question: str) -> tuple[int, str, int]:
    body = question.removeprefix("What is ").removesuffix("?")
    left, right = body.split("*")
    return int(left), "*", int(right)


# --- data ------------------------------------------------------------------------------------


def test_files_are_deterministic_and_seeded(tmp_path: Path) -> None:
    sizes = {"n_sft": 40, "n_train": 60, "n_eval": 30}
    a = write_calculator_data(tmp_path / "a", seed=3, **sizes)
    b = write_calculator_data(tmp_path / "b", seed=3, **sizes)
    c = write_calculator_data(tmp_path / "c", seed=4, **sizes)
    assert set(a) == {"sft", "prompts", "eval_prompts"}
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes()
        assert a[name].read_bytes() != c[name].read_bytes()
    assert [len(read(a[n])) for n in ("sft", "prompts", "eval_prompts")] == [40, 60, 30]


def test_default_problems_are_3_by_2_digit_products_of_5_digits_and_eval_is_held_out(tmp_path: Path) -> None:
    files = write_calculator_data(tmp_path, seed=0, n_sft=300, n_train=300, n_eval=100)
    eval_rows, train_rows = read(files["eval_prompts"]), read(files["prompts"])
    sft_questions = [row["messages"][0]["content"] for row in read(files["sft"])]
    eval_problems = [problem_of(row["prompt"][0]["content"]) for row in eval_rows]
    assert len(set(eval_problems)) == len(eval_problems)  # distinct
    train_questions = [row["prompt"][0]["content"] for row in train_rows]
    others = {problem_of(q) for q in sft_questions + train_questions}
    assert not others & set(eval_problems)
    for row in eval_rows + train_rows:
        left, _, right = problem_of(row["prompt"][0]["content"])
        assert 200 <= left <= 999 and 50 <= right <= 99
        assert row["answer"] == str(left * right) and len(row["answer"]) == 5
        assert row["prompt"] == [{"role": "user", "content": f"What is {left}*{right}?"}]


def test_sft_traces_come_in_equal_shares_per_answer_length(tmp_path: Path) -> None:
    files = write_calculator_data(tmp_path, seed=0, n_sft=400, n_train=400, n_eval=100, left=(100, 999), right=(10, 99))
    sft_lengths = [len(row["messages"][2]["content"]) for row in read(files["sft"])]
    assert sft_lengths.count(4) == sft_lengths.count(5) == 200  # products 100..999 x 10..99: 4 or 5 digits
    rl_lengths = [len(row["answer"]) for row in read(files["prompts"])]
    assert 0.1 < rl_lengths.count(4) / len(rl_lengths) < 0.3  # RL prompts keep the natural mix (~20%)

    pool = [Problem(a, "*", b) for a, b in ((100, 10), (500, 90), (101, 10), (999, 99), (102, 10))]
    assert [len(str(p.answer)) for p in balance_answer_lengths(pool, 4)] == [4, 5, 4, 5]  # in turn
    assert balance_answer_lengths(pool, 5)[-1] == Problem(102, "*", 10)  # 5 digits ran out: 4s go on
    with pytest.raises(ConfigError, match="only 5 sft problems could be drawn, 6 asked"):
        balance_answer_lengths(pool, 6)


def test_a_tiny_problem_space_keeps_the_splits_apart(tmp_path: Path) -> None:
    # 2 x 2 problems: 2 held out for eval, the others fill sft and train
    files = write_calculator_data(tmp_path, n_sft=20, n_train=20, n_eval=2, left=(1, 2), right=(3, 4))
    eval_set = {r["prompt"][0]["content"] for r in read(files["eval_prompts"])}
    train_set = {r["prompt"][0]["content"] for r in read(files["prompts"])}
    assert len(eval_set) == 2 and len(train_set) == 2 and not eval_set & train_set


def test_sft_traces_parse_and_carry_the_tools_real_output() -> None:
    messages = sft_trace(Problem(123, "*", 45))
    assert messages == [
        {"role": "user", "content": "What is 123*45?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5535"},
        {"role": "assistant", "content": "The answer is 5535."},
    ]
    parsed = parse_tool_calls(messages[1]["content"])
    assert parsed.calls == (ToolCall("call_0_0", "calculator", {"expression": "123*45"}),)
    assert parsed.content == ""
    assert calculator(**parsed.calls[0].arguments) == messages[2]["content"]
    assert parse_tool_calls(messages[3]["content"]).calls == ()
    assert is_correct(messages[3]["content"], "5535")


def test_sft_rows_are_valid_sft_lines(tmp_path: Path) -> None:
    files = write_calculator_data(tmp_path, n_sft=20, n_train=5, n_eval=5)
    for row in read(files["sft"]):
        assert check_line(row, "sft") is None
        call = parse_tool_calls(row["messages"][1]["content"]).calls[0]
        assert isinstance(call, ToolCall)
        answer = str(eval(call.arguments["expression"]))  # noqa: S307 - our own "123*45" strings
        assert row["messages"][2]["content"] == answer
        assert answer_from_text(row["messages"][3]["content"]) == answer
    for row in read(files["prompts"]):
        assert check_line(row, "prompt") is None


def test_direct_share_of_traces_answer_without_the_tool(tmp_path: Path) -> None:
    """`direct_share` turns that share of the traces (at seeded places) into user -> final answer,
    the tool still offered; the problems, the prompts and the eval split stay as they were."""
    plain = write_calculator_data(tmp_path / "plain", n_sft=50, n_train=5, n_eval=5)
    mixed = write_calculator_data(tmp_path / "mixed", n_sft=50, n_train=5, n_eval=5, direct_share=0.8)
    again = write_calculator_data(tmp_path / "again", n_sft=50, n_train=5, n_eval=5, direct_share=0.8)
    assert mixed["sft"].read_bytes() == again["sft"].read_bytes()
    for name in ("prompts", "eval_prompts"):
        assert mixed[name].read_bytes() == plain[name].read_bytes()
    direct = 0
    for p_row, m_row in zip(read(plain["sft"]), read(mixed["sft"]), strict=True):
        assert m_row["tools"] == p_row["tools"] and m_row["messages"][0] == p_row["messages"][0]
        if len(m_row["messages"]) == 2:
            direct += 1
            assert m_row["messages"][1] == {"role": "assistant", "content": p_row["messages"][3]["content"]}
            assert check_line(m_row, "sft") is None
        else:
            assert m_row == p_row
    assert direct == 40
    assert len(read(write_calculator_data(tmp_path / "all", n_sft=7, n_train=1, n_eval=1, direct_share=1.0)["sft"])[0]["messages"]) == 2
    with pytest.raises(ConfigError, match=r"direct_share must be in \[0, 1\], got 1.5"):
        write_calculator_data(tmp_path / "bad", n_sft=2, n_train=2, n_eval=2, direct_share=1.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_sft": 0}, "n_sft must be >= 1"),
        ({"n_eval": 0}, "n_eval must be >= 1"),
        ({"ops": ("/",)}, "unknown op"),
        ({"left": (5, 4)}, "range is empty"),
        ({"right": (-3, 4)}, "must be >= 0"),
        ({"left": (1, 2), "right": (1, 2), "n_eval": 3}, "at most half of the 4 distinct problems"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        write_calculator_data(tmp_path, **{"n_sft": 2, "n_train": 2, "n_eval": 2, **kwargs})


def test_digits_range() -> None:
    assert digits_range(1) == (0, 9) and digits_range(3) == (100, 999)
    for bad in (0, 31):
        with pytest.raises(ConfigError, match="digits"):
            digits_range(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 5535.", "5535"),
        ("123*45 = 5535", "5535"),  # the last integer, not the first
        ("5535", "5535"),
        ("It is -18.", "-18"),
        ("-7", "-7"),
        ("12-30 is -18", "-18"),
        ("5-3", "3"),  # a minus after a digit is an operator
        ("007", "7"),
        ("-0", "0"),
        ("5535.0", "5535"),
        ("about 2.5", None),
        ("no numbers", None),
        ("", None),
    ],
)
def test_answer_from_text(text: str, expected: str | None) -> None:
    assert answer_from_text(text) == expected


def test_is_correct_and_score() -> None:
    assert is_correct("The answer is 5535.", "5535") and score("so 5535", "5535") == 1.0
    assert not is_correct("5535 or 5536", "5535") and score("5536", "5535") == 0.0
    assert is_correct("-18", " -18 ") and is_correct("0018", "18")
    assert not is_correct("nothing", "5535") and not is_correct(CALL, "5535")


# --- the env ---------------------------------------------------------------------------------


def run_episode(env: CalculatorEnv, contents: list[str]):
    async def go():
        opening = await env.reset(ROW)
        return opening, [await env.step({"role": "assistant", "content": c}) for c in contents]

    return asyncio.run(go())


def test_env_tool_turn_then_final_answer() -> None:
    env = CalculatorEnv()
    assert isinstance(env, Env)
    assert [t.name for t in env.tools] == ["calculator"]
    opening, (call, final) = run_episode(env, [CALL, "The answer is 5535."])
    assert opening == ROW["prompt"]
    assert not call.done and call.reward == 0.0
    assert [(m["role"], m["content"]) for m in call.messages] == [("tool", "5535")]
    assert call.info["tool_calls"] == 1 and call.info["tool_errors"] == 0
    assert final.done and final.reward == 1.0 and final.messages == ()
    assert final.info == {"extracted": "5535"}


def test_env_wrong_or_missing_final_answer() -> None:
    _, (wrong,) = run_episode(CalculatorEnv(), ["The answer is 5536."])
    assert wrong.done and wrong.reward == 0.0 and wrong.info["extracted"] == "5536"
    _, (none,) = run_episode(CalculatorEnv(), ["I don't know."])
    assert none.done and none.reward == 0.0 and none.info["extracted"] is None


def test_env_malformed_calls_come_back_as_errors_and_the_episode_goes_on() -> None:
    bad_json = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'
    unknown = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    bad_expr = tool_call_text("123*")
    two = CALL + "\n" + tool_call_text("2**10")
    _, steps = run_episode(CalculatorEnv(), [bad_json, unknown, bad_expr + two, "5535"])
    for step in steps[:3]:
        assert not step.done and step.reward == 0.0
    assert steps[0].messages[0]["content"].startswith("error: could not parse the tool call")
    assert steps[0].info["tool_error_kinds"] == {"bad_json": 1}
    assert "unknown tool 'search'" in steps[1].messages[0]["content"]
    assert [m["content"] for m in steps[2].messages][1:] == ["5535", "1024"]
    assert steps[2].messages[0]["content"].startswith("error: tool 'calculator' raised ValueError")
    assert steps[2].info["tool_calls"] == 3 and steps[2].info["tool_errors"] == 1
    assert steps[2].info["tool_error_kinds"] == {"tool_raised": 1}
    assert steps[3].done and steps[3].reward == 1.0

    stats = ToolStats()
    stats.record_episode(r for step in steps[:3] for r in step.info["tool_results"])
    assert stats.metrics()["tools/calls"] == 5 and stats.metrics()["tools/error_rate"] == 3 / 5


def test_env_needs_reset_and_an_answer() -> None:
    env = CalculatorEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(env.step({"role": "assistant", "content": "1"}))
    with pytest.raises(ConfigError, match='"answer"'):
        asyncio.run(env.reset({"prompt": "What is 1*2?"}))
    assert asyncio.run(env.reset({"prompt": "What is 1*2?", "answer": 2})) == [
        {"role": "user", "content": "What is 1*2?"}
    ]


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_data_calculator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    args = ["data", "calculator", str(out), "--n-sft", "8", "--n-train", "9", "--n-eval", "5", "--seed", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for name, lines in (("sft", 8), ("prompts", 9), ("eval_prompts", 5)):
        assert f"{out / name}.jsonl  ({lines} lines)" in printed
        assert len(read(out / f"{name}.jsonl")) == lines
    direct = write_calculator_data(tmp_path / "direct", seed=2, n_sft=8, n_train=9, n_eval=5)
    assert direct["sft"].read_bytes() == (out / "sft.jsonl").read_bytes()

    assert main(["data", "calculator", str(tmp_path / "d4"), "--left-digits", "4", "--n-eval", "3"]) == 0
    first = read(tmp_path / "d4" / "eval_prompts.jsonl")[0]["prompt"][0]["content"]
    assert 1000 <= problem_of(first)[0] <= 9999

    args = ["data", "calculator", str(tmp_path / "r"), "--left", "100-999", "--right", "10-99", "--n-sft", "6"]
    assert main(args) == 0
    ranged = write_calculator_data(tmp_path / "r-direct", n_sft=6, left=(100, 999), right=(10, 99))
    for name in ("sft", "prompts", "eval_prompts"):
        assert ranged[name].read_bytes() == (tmp_path / "r" / f"{name}.jsonl").read_bytes()
    assert main(["data", "calculator", str(tmp_path / "one"), "--left", "7", "--right", "3-9", "--n-eval", "2"]) == 0
    assert {problem_of(r["prompt"][0]["content"])[0] for r in read(tmp_path / "one" / "prompts.jsonl")} == {7}

    args = ["data", "calculator", str(tmp_path / "cold"), "--n-sft", "10", "--direct-share", "0.8", "--seed", "2"]
    assert main(args) == 0
    cold = write_calculator_data(tmp_path / "cold-direct", seed=2, n_sft=10, direct_share=0.8)
    assert cold["sft"].read_bytes() == (tmp_path / "cold" / "sft.jsonl").read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n-eval", "0"], "n_eval must be >= 1"),
        (["--ops", "/"], "unknown op"),
        (["--left-digits", "0"], "digits must be in 1..30"),
        (["--left", "5-3"], "left operand range is empty: 5..3"),
        (["--right", "ten-20"], "operand range must be LOW-HIGH"),
        (["--left", "-5-9"], "operand range must be LOW-HIGH"),
        (["--left", "1" * 31], "at most 30 digits per operand"),
        (["--left", "100-999", "--left-digits", "3"], "give --left or --left-digits, not both"),
        (["--n-train", "many"], "Invalid value for '--n-train'"),
        (["--direct-share", "2"], "Invalid value for '--direct-share'"),
    ],
)
def test_cli_data_calculator_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "calculator", str(tmp_path / "x"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_writes_as_many_traces_as_the_recipe_was_measured_with() -> None:
    """`rollout data calculator`'s default is the generator's (the demo's SFT figures assume 8000)."""
    import inspect

    from rollout.cli.data import calculator
    from rollout.tasks.calculator import DEFAULT_N_SFT

    assert inspect.signature(calculator).parameters["n_sft"].default.default == DEFAULT_N_SFT == 8000
