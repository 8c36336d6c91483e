"""The guess-the-number task: the `guess_number` env, its data and SFT traces, `rollout data guess-number`.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/rl/test_guess_number.py -q
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from rollout.cli.main import main
from rollout.data.formats import check_line
from rollout.errors import ConfigError, DataError
from rollout.inference.types import Completion, GenerationRequest, SamplingParams, derive_seed
from rollout.rl.envs import resolve_env
from rollout.rl.episode import EpisodeLimits, run_episodes
from rollout.rl.guess_env import GuessNumberEnv
from rollout.rl.types import Env, StepResult
from rollout.tasks.guess_number import (
    binary_search_guesses,
    parse_guess,
    prompt_row,
    question,
    random_search_guesses,
    sft_trace,
    write_guess_number_data,
)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def play(env: GuessNumberEnv, row: Mapping[str, Any], replies: Sequence[str]) -> list[StepResult]:
    async def go() -> list[StepResult]:
        await env.reset(row)
        return [await env.step({"role": "assistant", "content": text}) for text in replies]

    return asyncio.run(go())


async def binary_search(env: GuessNumberEnv, n: int, secret: int) -> list[StepResult]:
    """Drive the env with a binary search steered only by its answers."""
    await env.reset(prompt_row(n, secret))
    low, high, steps = 1, n, []
    while not steps or not steps[-1].done:
        guess = (low + high) // 2
        step = await env.step({"role": "assistant", "content": f"Guess: {guess}"})
        steps.append(step)
        if not step.done:
            (answer,) = step.messages
            assert answer["role"] == "user" and answer["content"] in ("higher", "lower")
            low, high = (guess + 1, high) if answer["content"] == "higher" else (low, guess - 1)
        assert len(steps) <= n
    return steps


# --- the env ----------------------------------------------------------------------------------


def test_the_env_answers_higher_lower_and_correct() -> None:
    env = GuessNumberEnv()
    assert isinstance(env, Env)
    higher, lower, correct = play(env, prompt_row(16, 11), ["Guess: 8", "Guess: 12", "Guess: 11"])
    assert (higher.messages, higher.reward, higher.done) == (({"role": "user", "content": "higher"},), 0.0, False)
    assert (lower.messages, lower.reward, lower.done) == (({"role": "user", "content": "lower"},), 0.0, False)
    assert (correct.messages, correct.reward, correct.done) == ((), 1.0, True)
    assert correct.info == {"guess": 11, "turn": 3, "secret": 11, "feedback": "correct"}
    assert higher.info["feedback"] == "higher" and lower.info["feedback"] == "lower"


@pytest.mark.parametrize("n", [1, 2, 3, 16, 100])
def test_binary_search_always_wins_within_log2_n_plus_1_turns(n: int) -> None:
    async def all_games() -> list[list[StepResult]]:
        return [await binary_search(GuessNumberEnv(), n, secret) for secret in range(1, n + 1)]

    games = asyncio.run(all_games())
    for steps in games:
        assert steps[-1].reward == 1.0 and sum(s.reward for s in steps) == 1.0
        assert len(steps) <= math.ceil(math.log2(n)) + 1 and len(steps) <= n.bit_length()
    assert max(len(steps) for steps in games) == n.bit_length()  # the bound is tight


@pytest.mark.parametrize(
    "text, expected",
    [("Guess: 7", 7), ("guess 7", 7), ("7", 7), (" GUESS: 12. ", 12), ("Guess = 3!", 3), ("-2", -2),
     ("<think>middle of 1..16</think>Guess: 8", 8),
     ("I guess 7", None), ("Guess: 7 or 8", None), ("seven", None), ("", None), ("Guess: 7.5", None)],
)
def test_parse_guess_is_strict(text: str, expected: int | None) -> None:
    assert parse_guess(text) == expected


def test_invalid_and_out_of_range_replies_get_a_correction_and_use_a_turn() -> None:
    env = GuessNumberEnv(decay=True)
    invalid, out_of_range, correct = play(env, prompt_row(16, 5), ["I think it is 5", "Guess: 17", "Guess: 5"])
    assert not invalid.done and invalid.reward == 0.0 and invalid.info["feedback"] == "invalid"
    assert invalid.info["guess"] is None
    assert invalid.messages[0]["content"] == 'Invalid reply. Answer with only "Guess: N", N an integer from 1 to 16.'
    assert not out_of_range.done and out_of_range.info["feedback"] == "out_of_range"
    assert "out of range" in out_of_range.messages[0]["content"]
    assert correct.done and correct.info["turn"] == 3
    assert correct.reward == pytest.approx(1 - 2 / 16)  # both bad replies counted as turns


def test_the_envs_own_max_turns_ends_the_game_with_reward_0() -> None:
    steps = play(GuessNumberEnv(max_turns=3), prompt_row(16, 16), ["1", "2", "3"])
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1].reward == 0.0 and steps[-1].messages == () and steps[-1].info["out_of_turns"] is True


def test_decay_values() -> None:
    def reward(turns: int, **options: Any) -> float:
        wrong = ["Guess: 1"] * (turns - 1)
        return play(GuessNumberEnv(**options), prompt_row(16, 9), [*wrong, "Guess: 9"])[-1].reward

    assert reward(1, decay=True) == 1.0
    assert reward(5, decay=True) == pytest.approx(0.75)  # 1 - 4/16: the horizon is n without max_turns
    assert reward(3, decay=True, max_turns=8) == pytest.approx(0.75)  # 1 - 2/8
    assert reward(8, decay=True, max_turns=8) == pytest.approx(0.125)
    assert reward(5) == 1.0  # no decay


def test_progress_rewards_the_bits_each_guess_learns() -> None:
    # secret 11 in 1..16: 8 leaves 9..16 (1 bit of 4), 12 leaves 9..11 (log2 8/3), 11 is the rest
    steps = play(GuessNumberEnv(progress=0.5), prompt_row(16, 11), ["Guess: 8", "Guess: 12", "Guess: 11"])
    assert [s.reward for s in steps] == pytest.approx([0.5 / 4, 0.5 * math.log2(8 / 3) / 4, 1 + 0.5 * math.log2(3) / 4])
    assert sum(s.reward for s in steps) == pytest.approx(1.5)  # a found secret: 1 + w, whatever the path
    # wasted turns learn nothing: invalid, out of range, a guess outside the numbers still possible
    wasted = play(GuessNumberEnv(progress=1.0), prompt_row(16, 11), ["Guess: 12", "what?", "Guess: 0", "Guess: 14"])
    assert [s.reward for s in wasted] == pytest.approx([(4 - math.log2(11)) / 4, 0.0, 0.0, 0.0])
    # out of turns: the bits learned are kept, the success reward is not
    halving = play(GuessNumberEnv(progress=1.0, max_turns=2), prompt_row(16, 11), ["Guess: 8", "Guess: 12"])
    nibbling = play(GuessNumberEnv(progress=1.0, max_turns=2), prompt_row(16, 11), ["Guess: 1", "Guess: 2"])
    assert halving[-1].done and halving[-1].info["out_of_turns"] and nibbling[-1].done
    assert sum(s.reward for s in halving) == pytest.approx(math.log2(16 / 3) / 4)
    assert sum(s.reward for s in nibbling) == pytest.approx(math.log2(16 / 14) / 4)
    with_decay = play(GuessNumberEnv(progress=1.0, decay=True, max_turns=4), prompt_row(16, 11), ["8", "12", "11"])
    assert sum(s.reward for s in with_decay) == pytest.approx(1 - 2 / 4 + 1)

    async def binary_returns(n: int) -> set[float]:
        return {round(sum(s.reward for s in await binary_search(GuessNumberEnv(progress=0.25), n, k)), 9)
                for k in range(1, n + 1)}  # fmt: skip

    assert asyncio.run(binary_returns(16)) == asyncio.run(binary_returns(100)) == {1.25}
    assert asyncio.run(binary_returns(1)) == {1.0}  # n = 1: nothing to learn
    assert play(GuessNumberEnv(), prompt_row(16, 11), ["Guess: 8"])[0].reward == 0.0  # off by default
    with pytest.raises(ConfigError, match="options.progress: "):
        GuessNumberEnv(progress=-1.0)


def test_rows_and_options_are_validated() -> None:
    env = resolve_env("guess_number")(n=8, decay=True)
    messages = asyncio.run(env.reset({"secret": 8}))  # n from the options, the standard question
    assert messages == [{"role": "user", "content": question(8)}]
    for row in ({"n": 16}, {"n": 16, "secret": 17}, {"n": 16, "secret": 0}, {"n": 16, "secret": True}):
        with pytest.raises(DataError, match=r'needs an integer "secret" in 1\.\.16'):
            asyncio.run(GuessNumberEnv().reset(row))
    with pytest.raises(DataError, match='"n" must be an integer'):
        asyncio.run(GuessNumberEnv().reset({"n": 0, "secret": 1}))
    with pytest.raises(ConfigError, match=r"env guess_number: options.max_turn: unknown field \(known options: n,"):
        GuessNumberEnv(max_turn=4)
    with pytest.raises(ConfigError, match="options.n: "):
        GuessNumberEnv(n=0)
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(GuessNumberEnv().step({"role": "assistant", "content": "1"}))


# --- data ------------------------------------------------------------------------------------


def test_generator_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    sizes = {"n_sft": 30, "n_train": 40, "n_eval": 20}
    a = write_guess_number_data(tmp_path / "a", seed=3, **sizes)
    b = write_guess_number_data(tmp_path / "b", seed=3, **sizes)
    c = write_guess_number_data(tmp_path / "c", seed=4, **sizes)
    assert sorted(a) == ["eval_prompts", "prompts", "sft"]
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes()
        assert a[name].read_bytes() != c[name].read_bytes()
    rows = read(a["prompts"])
    assert len(rows) == 40 and {r["n"] for r in rows} == {16}
    assert all(1 <= r["secret"] <= 16 for r in rows) and len({r["secret"] for r in rows}) > 8
    for row in rows + read(a["eval_prompts"]):
        assert check_line(row, "prompt") is None
        assert row["prompt"] == [{"role": "user", "content": question(16)}]
    for row in read(a["sft"]):
        assert check_line(row, "sft") is None


@pytest.mark.parametrize("kwargs, message", [({"n": 0}, "n must be an integer in 1.."), ({"n_eval": 0}, "n_eval")])
def test_bad_generator_arguments_are_config_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        write_guess_number_data(tmp_path, **kwargs)


@pytest.mark.parametrize("n", [1, 7, 16, 64])
def test_sft_traces_are_binary_searches_the_env_accepts(n: int) -> None:
    for secret in range(1, n + 1):
        trace = sft_trace(n, secret)
        assert trace[0] == {"role": "user", "content": question(n)}
        assert [m["role"] for m in trace[1:]] == ["assistant", "user"] * (len(trace) // 2 - 1) + ["assistant"]
        guesses = [parse_guess(m["content"]) for m in trace[1::2]]
        assert guesses == binary_search_guesses(n, secret) and guesses[-1] == secret
        assert len(guesses) <= n.bit_length()
        low, high = 1, n  # each guess is the middle of what is still possible
        for guess, answer in zip(guesses, [m["content"] for m in trace[2::2]], strict=False):
            assert guess == (low + high) // 2
            low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
        steps = play(GuessNumberEnv(), prompt_row(n, secret), [m["content"] for m in trace[1::2]])
        assert [s.messages[0]["content"] for s in steps[:-1]] == [m["content"] for m in trace[2::2]]
        assert steps[-1].done and steps[-1].info["feedback"] == "correct" and steps[-1].reward == 1.0


def test_random_and_mixed_traces_search_among_the_numbers_still_possible(tmp_path: Path) -> None:
    sizes = {"n_sft": 2000, "n_train": 5, "n_eval": 5}
    rand = write_guess_number_data(tmp_path / "r", seed=1, strategy="random", **sizes)
    again = write_guess_number_data(tmp_path / "r2", seed=1, strategy="random", **sizes)
    binary = write_guess_number_data(tmp_path / "b", seed=1, **sizes)
    assert rand["sft"].read_bytes() == again["sft"].read_bytes()
    assert rand["prompts"].read_bytes() == binary["prompts"].read_bytes()  # the strategy only changes sft
    bin_secrets = [parse_guess(r["messages"][-1]["content"]) for r in read(binary["sft"])]
    lengths = []
    for row, secret in zip(read(rand["sft"]), bin_secrets, strict=True):
        assert check_line(row, "sft") is None
        trace = row["messages"]
        guesses = [parse_guess(m["content"]) for m in trace[1::2]]
        assert guesses[-1] == secret  # the same games as the binary traces
        low, high = 1, 16  # every guess is still possible given the answers so far
        for guess, answer in zip(guesses, [m["content"] for m in trace[2::2]], strict=False):
            assert low <= guess <= high
            low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
        steps = play(GuessNumberEnv(), prompt_row(16, secret), [m["content"] for m in trace[1::2]])
        assert steps[-1].done and steps[-1].reward == 1.0
        lengths.append(len(guesses))
    # slower than binary search (<= 5 guesses): 58% within 4 guesses, mean 4.2 (simulated, 20000 games)
    within4 = sum(k <= 4 for k in lengths) / len(lengths)
    assert 0.53 <= within4 <= 0.63 and 3.9 <= sum(lengths) / len(lengths) <= 4.5 and max(lengths) > 6
    # "mixed": the middle half of the time, else random; still every guess possible, 72% within 4
    mixed = read(write_guess_number_data(tmp_path / "m", seed=1, strategy="mixed", **sizes)["sft"])
    first = [parse_guess(r["messages"][1]["content"]) for r in mixed]
    assert 0.45 <= first.count(8) / len(first) <= 0.6  # 1/2 + 1/2 * 1/16
    mixed_lengths = [len(r["messages"]) // 2 for r in mixed]
    assert 0.67 <= sum(k <= 4 for k in mixed_lengths) / len(mixed_lengths) <= 0.77
    rng = random.Random(0)
    assert random_search_guesses(1, 1, rng) == [1]
    assert random_search_guesses(16, 11, rng, middle=1.0) == binary_search_guesses(16, 11)
    with pytest.raises(ConfigError, match="strategy must be one of binary, random, mixed"):
        write_guess_number_data(tmp_path / "x", strategy="ternary")


def test_cli_data_guess_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    args = ["data", "guess-number", str(out), "--n", "8", "--train", "9", "--test", "5", "--n-sft", "4", "--seed", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for name, lines in (("sft", 4), ("prompts", 9), ("eval_prompts", 5)):
        assert f"{out / name}.jsonl  ({lines} lines)" in printed
    direct = write_guess_number_data(tmp_path / "direct", seed=2, n=8, n_sft=4, n_train=9, n_eval=5)
    for name, path in direct.items():
        assert path.read_bytes() == (out / f"{name}.jsonl").read_bytes()
    assert {r["n"] for r in read(out / "prompts.jsonl")} == {8}
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "guess-number", str(tmp_path / "x"), "--n", "0"])
    assert exit_info.value.code == 2
    assert "n must be an integer in 1..1000000000, got 0" in capsys.readouterr().err


# --- through the episode loop ------------------------------------------------------------------


class SearchingSampler:
    """A fake policy: choice 0 binary-searches from the env's answers in its prompt; choice 1 babbles."""

    def __init__(self, tokenizer: Any, seeds: Mapping[int, tuple[int, int, int]]) -> None:
        self.tokenizer = tokenizer
        self.seeds = seeds  # seed -> (group, index, turn)

    def reply(self, prompt_ids: Sequence[int], index: int, n: int) -> str:
        if index == 1:
            return "hmm"
        context = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        game = context[context.index(question(n)) + len(question(n)):]
        low, high = 1, n
        for guess, answer in re.findall(r"Guess: (\d+)\W+(?:user\W+)?(higher|lower)", game):
            low, high = (int(guess) + 1, high) if answer == "higher" else (low, int(guess) - 1)
        return f"Guess: {(low + high) // 2}"

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future]:
        futures = []
        for request in requests:
            assert request.params is not None
            _, index, _ = self.seeds[request.params.seed]
            text = self.reply(request.prompt_token_ids, index, 16)
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
            future = asyncio.get_running_loop().create_future()
            future.set_result((Completion(0, text, tuple(ids), tuple([-0.5] * len(ids)), "stop",
                                          len(request.prompt_token_ids), len(ids), request.prompt_token_ids),))
            futures.append(future)
        return futures


def test_run_episodes_plays_the_game_token_in_token_out(rl_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rl_model_dir)
    seeds = {derive_seed(5, g, j, t): (g, j, t) for g in (0, 1) for j in range(2) for t in range(6)}
    starts = [(0, prompt_row(16, 11)), (1, prompt_row(16, 1))]
    groups = asyncio.run(run_episodes(
        SearchingSampler(tokenizer, seeds), tokenizer, resolve_env("guess_number"), starts, num_generations=2,
        sampling=SamplingParams(temperature=1.0, max_tokens=16), seed=5,
        limits=EpisodeLimits(max_turns=5, max_episode_tokens=400),
    ))
    (searcher, babbler), (searcher_1, _) = groups
    assert searcher.finish_reason == "done" and searcher.reward == 1.0
    assert [m["content"] for m in searcher.messages[1:]] == [
        "Guess: 8", "higher", "Guess: 12", "lower", "Guess: 10", "higher", "Guess: 11"]
    assert searcher.turn_rewards == (0.0, 0.0, 0.0, 1.0)
    assert [s.source for s in searcher.segments] == ["sampled", "env"] * 3 + ["sampled"]
    assert searcher_1.reward == 1.0 and searcher_1.num_turns == 4  # 8, 4, 2, 1
    assert babbler.finish_reason == "max_turns" and babbler.reward == 0.0 and babbler.num_turns == 5
    assert babbler.messages[2]["content"].startswith("Invalid reply.")
