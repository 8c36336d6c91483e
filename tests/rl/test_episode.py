"""Multi-turn episodes: token-exact records, truncation, env failures, seeds, one engine batch per turn."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from rollout.inference.types import Completion, GenerationRequest, SamplingParams, derive_seed
from rollout.rl.episode import EpisodeLimits, episode_metrics, run_episodes
from rollout.rl.types import StepResult

SAMPLING = SamplingParams(temperature=1.0, max_tokens=64)


@pytest.fixture(scope="module")
def tokenizer(rl_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rl_model_dir)


class ScriptedSampler:
    """Answers each request with the next scripted reply of its episode; records every batch.

    `replies[(group_id, index)]` is a list of (text, finish_reason) per turn; the token ids are
    the tokenizer's encoding of the text plus eos (or `odd_ids` when given: ids that decode to
    the same text but are not what re-tokenising gives).
    """

    def __init__(self, tokenizer: Any, replies: Mapping[tuple[int, int], Sequence[tuple[str, str]]],
                 seeds: Mapping[int, tuple[int, int, int]], odd_ids: Mapping[str, list[int]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.replies = replies
        self.seeds = seeds  # seed -> (group, index, turn)
        self.odd_ids = odd_ids or {}
        self.batches: list[list[GenerationRequest]] = []

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future]:
        self.batches.append(list(requests))
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            assert request.params is not None and request.params.n == 1
            group, index, turn = self.seeds[request.params.seed]
            text, finish = self.replies[(group, index)][turn]
            ids = list(self.odd_ids.get(text) or self.tokenizer.encode(text, add_special_tokens=False))
            if finish == "stop":
                ids.append(self.tokenizer.eos_token_id)
            ids = ids[: request.params.max_tokens]
            logprobs = tuple(-0.5 - 0.01 * i for i in range(len(ids)))
            future = loop.create_future()
            future.set_result((Completion(0, text, tuple(ids), logprobs, finish, len(request.prompt_token_ids),
                                          len(ids), request.prompt_token_ids),))
            futures.append(future)
        return futures

    def submit(self, request: GenerationRequest) -> asyncio.Future:
        return self.submit_all([request])[0]


def seed_table(seed: int, groups: Sequence[int], n: int, turns: int) -> dict[int, tuple[int, int, int]]:
    return {derive_seed(seed, g, j, t): (g, j, t) for g in groups for j in range(n) for t in range(turns)}


class ToolThenAnswer:
    """Turn 0: answers any reply with a tool message; turn 1: done, reward 1 if the reply says 42."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": row["q"]}]

    async def step(self, message: Mapping[str, str]) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult(({"role": "tool", "content": "42"},), 0.0, False, {"tool_calls": 1})
        return StepResult((), 1.0 if "42" in message["content"] else 0.0, True)


def run(sampler: Any, tokenizer: Any, factory: Any, starts: Any, *, n: int = 1, limits: EpisodeLimits | None = None,
        seed: int = 7):
    return asyncio.run(run_episodes(sampler, tokenizer, factory, starts, num_generations=n, sampling=SAMPLING,
                                    seed=seed, limits=limits or EpisodeLimits(max_turns=4, max_episode_tokens=200)))


def test_two_turn_episode_is_the_chat_template_rendering_token_for_token(tokenizer):
    replies = {(0, 0): [('<tool_call>{"name": "calculator"}</tool_call>', "stop"), ("it is 42", "stop")]}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0], 1, 2))
    [[ep]] = run(sampler, tokenizer, ToolThenAnswer, [(0, {"q": "What is 6*7?"})])
    assert ep.finish_reason == "done" and not ep.truncated
    assert ep.turn_rewards == (0.0, 1.0) and ep.reward == 1.0 and ep.tool_calls == 1
    conversation = [{"role": "user", "content": "What is 6*7?"},
                    {"role": "assistant", "content": replies[(0, 0)][0][0]},
                    {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "it is 42"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True)
    rendered = list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
    record = list(ep.trajectory().token_ids)
    # The template closes the last assistant turn with "\n" after eos; the episode ends at eos.
    assert record == rendered[: len(record)] and len(rendered) - len(record) == len(
        tokenizer.encode("\n", add_special_tokens=False))
    assert [s.source for s in ep.trajectory().segments] == ["prompt", "sampled", "tool", "sampled"]
    # The mask covers exactly the sampled tokens; log-probs are the sampler's there and 0 elsewhere.
    mask = ep.completion_mask
    sampled = [t for t, m in zip(ep.completion_ids, mask, strict=True) if m]
    assert sampled == [*tokenizer.encode(replies[(0, 0)][0][0], add_special_tokens=False), tokenizer.eos_token_id,
                       *tokenizer.encode("it is 42", add_special_tokens=False), tokenizer.eos_token_id]
    assert all(lp == 0.0 for lp, m in zip(ep.completion_logprobs, mask, strict=True) if not m)
    assert ep.turn_ends == tuple(i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1]))
    # One engine batch per turn, each request the full token context so far.
    assert [len(b) for b in sampler.batches] == [1, 1]
    second_prompt = list(sampler.batches[1][0].prompt_token_ids)
    assert record[: len(second_prompt)] == second_prompt
    assert second_prompt[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]


def test_sampled_tokens_are_kept_verbatim_even_when_retokenising_differs(tokenizer):
    text = "it is 42"
    canonical = tokenizer.encode(text, add_special_tokens=False)
    # The same text spelled one byte-level token per character: decodes equal, encodes differently.
    odd = [tokenizer.convert_tokens_to_ids(tok) for ch in text for tok in tokenizer.tokenize(ch)]
    assert tokenizer.decode(odd) == text and odd != canonical
    replies = {(0, 0): [("call", "stop"), (text, "stop")]}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0], 1, 2), odd_ids={text: odd})
    [[ep]] = run(sampler, tokenizer, ToolThenAnswer, [(0, {"q": "q"})])
    last = ep.trajectory().segments[-1]
    assert last.source == "sampled" and list(last.token_ids) == [*odd, tokenizer.eos_token_id]


def test_group_choices_are_seeded_per_group_choice_and_turn(tokenizer):
    replies = {(g, j): [("call", "stop"), ("42", "stop")] for g in (3, 5) for j in range(2)}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(11, [3, 5], 2, 2))
    groups = run(sampler, tokenizer, ToolThenAnswer, [(3, {"q": "a"}), (5, {"q": "b"})], n=2, seed=11)
    assert [[(e.group_id, e.index) for e in g] for g in groups] == [[(3, 0), (3, 1)], [(5, 0), (5, 1)]]
    assert [len(b) for b in sampler.batches] == [4, 4]  # every live episode's turn in one batch
    assert [r.params.seed for r in sampler.batches[1]] == [derive_seed(11, g, j, 1) for g in (3, 5) for j in range(2)]


class NeverDone:
    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": "go"}]

    async def step(self, message: Mapping[str, str]) -> StepResult:
        return StepResult(({"role": "user", "content": "again"},), 0.25, False)


def test_max_turns_truncates_and_keeps_the_rewards_earned(tokenizer):
    replies = {(0, 0): [("no", "stop")] * 3}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0], 1, 3))
    [[ep]] = run(sampler, tokenizer, NeverDone, [(0, {})], limits=EpisodeLimits(max_turns=3, max_episode_tokens=500))
    assert ep.finish_reason == "max_turns" and ep.truncated and ep.num_turns == 3
    assert ep.turn_rewards == (0.25, 0.25, 0.25) and math.isclose(ep.reward, 0.75)
    assert [s.source for s in ep.segments] == ["sampled", "env", "sampled", "env", "sampled"]


def test_max_episode_tokens_truncates_before_the_budget_is_exceeded(tokenizer):
    replies = {(0, 0): [("no no no", "stop")] * 10}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0], 1, 10))
    limits = EpisodeLimits(max_turns=10, max_episode_tokens=30)
    [[ep]] = run(sampler, tokenizer, NeverDone, [(0, {})], limits=limits)
    assert ep.finish_reason == "max_episode_tokens" and ep.truncated
    assert len(ep.completion_ids) <= 30 and ep.num_turns < 10
    # Every turn's request was capped by the room left.
    for batch in sampler.batches:
        for request in batch:
            assert request.params.max_tokens <= 30


def test_a_reply_cut_by_max_tokens_goes_to_the_env_and_the_turn_is_closed_with_eos(tokenizer):
    replies = {(0, 0): [("a very long reply", "length"), ("short", "stop")]}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0], 1, 2))
    [[ep]] = run(sampler, tokenizer, NeverDone, [(0, {})], limits=EpisodeLimits(max_turns=2, max_episode_tokens=200))
    assert ep.finish_reason == "max_turns" and ep.turn_rewards == (0.25, 0.25)
    first, closing = ep.segments[0], ep.segments[1]
    assert first.source == "sampled" and first.token_ids[-1] != tokenizer.eos_token_id
    assert closing.source == "env" and closing.token_ids[0] == tokenizer.eos_token_id
    assert ep.messages[1] == {"role": "assistant", "content": "a very long reply"}


class Broken:
    def __init__(self, how: str) -> None:
        self.how = how

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        if self.how == "reset":
            raise RuntimeError("reset exploded")
        return [{"role": "user", "content": "go"}]

    async def step(self, message: Mapping[str, str]) -> Any:
        if self.how == "raise":
            raise ValueError("step exploded")
        if self.how == "slow":
            await asyncio.sleep(5)
        if self.how == "junk":
            return {"reward": 1}
        if self.how == "nan":
            return StepResult((), float("nan"), True)
        return StepResult((), 1.0, True)


@pytest.mark.parametrize("how", ["reset", "raise", "slow", "junk", "nan"])
def test_an_env_failure_ends_only_its_episode_with_reward_zero(tokenizer, how):
    replies = {(g, 0): [("x", "stop")] for g in (0, 1)}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, [0, 1], 1, 1))
    envs = iter([Broken(how), Broken("ok")])
    limits = EpisodeLimits(max_turns=2, max_episode_tokens=100, step_timeout_s=0.2)
    [[bad], [good]] = run(sampler, tokenizer, lambda: next(envs), [(0, {}), (1, {})], limits=limits)
    assert bad.finish_reason == "env_error" and bad.reward == 0.0 and bad.error
    assert ("timed out" in bad.error) == (how == "slow")
    assert good.finish_reason == "done" and good.reward == 1.0
    assert episode_metrics([bad, good])["episode/env_errors"] == 1.0


class Sleepy:
    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": "go"}]

    async def step(self, message: Mapping[str, str]) -> StepResult:
        await asyncio.sleep(0.3)
        return StepResult((), 1.0, True)


def test_env_steps_run_concurrently_within_the_bound(tokenizer):
    replies = {(g, 0): [("x", "stop")] for g in range(8)}
    sampler = ScriptedSampler(tokenizer, replies, seed_table(7, range(8), 1, 1))
    t0 = time.perf_counter()
    run(sampler, tokenizer, Sleepy, [(g, {}) for g in range(8)],
        limits=EpisodeLimits(max_turns=1, max_episode_tokens=50, max_concurrent_steps=4))
    elapsed = time.perf_counter() - t0
    assert 0.55 < elapsed < 1.5  # two waves of four 0.3 s steps, not eight in a row (2.4 s)


def test_limits_are_validated():
    from rollout.errors import ConfigError

    with pytest.raises(ConfigError, match="max_turns"):
        EpisodeLimits(max_turns=0)


def test_real_engine_episodes_are_token_exact_against_a_teacher_forced_pass(rl_engine, rl_model_dir, tokenizer):
    """Three-turn episodes on the hf engine (turns 2 and 3 prefill only their new tokens on top of the
    previous turn's kept cache): a forward pass over each trajectory's tokens gives the engine's
    log-probs at every sampled token, so what is trained is what was sampled."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.inference.sampler import EngineSampler

    sampler = EngineSampler(rl_engine, max_batch=64)
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=60)
    reused = rl_engine.kept_cache_stats["reused"]
    groups = asyncio.run(run_episodes(sampler, tokenizer, NeverDone, [(0, {}), (1, {})], num_generations=2,
                                      sampling=SamplingParams(temperature=1.0, max_tokens=6), seed=3, limits=limits))
    sampler.close()
    # turns 2 and 3 of the 4 episodes continued the engine's kept caches; none is left behind
    assert rl_engine.kept_cache_stats["reused"] - reused == 8
    assert len(rl_engine._kept) == 0
    model = AutoModelForCausalLM.from_pretrained(rl_model_dir).eval()
    episodes = [e for g in groups for e in g]
    assert all(e.num_turns == 3 and e.finish_reason == "max_turns" for e in episodes)
    for ep in episodes:
        traj = ep.trajectory()
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits.float(), -1)[0]
        pos = len(ep.prompt_ids)
        for seg in ep.segments:
            if seg.source == "sampled":
                for k, (token, lp) in enumerate(zip(seg.token_ids, seg.logprobs, strict=True)):
                    assert abs(float(logps[pos + k - 1, token]) - lp) < 2e-4
            pos += len(seg.token_ids)


def test_the_hf_engine_renders_tools_like_the_episode_prompt(rl_engine, tokenizer):
    from rollout.rl.chat_tokens import prompt_ids
    from rollout.tasks.calculator import calculator_tool

    messages = [{"role": "user", "content": "What is 123*45?"}]
    schema = calculator_tool().openai_schema()
    with_tools = rl_engine.tokenize(messages, [schema])
    assert list(with_tools) == list(prompt_ids(tokenizer, messages, tools=[schema]))
    assert with_tools != rl_engine.tokenize(messages)


class SlowEngine:
    """An in-process engine whose `generate` blocks its thread for `seconds` (a big batch on the
    CPU) and answers from a script; records the thread of every call."""

    def __init__(self, scripted: ScriptedSampler, seconds: float) -> None:
        self.scripted, self.seconds, self.threads = scripted, seconds, []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[tuple[Completion, ...]]:
        self.threads.append(threading.current_thread())
        time.sleep(self.seconds)
        return [f.result() for f in self.scripted.submit_all(requests)]


def test_episodes_generating_on_the_loop_thread_spend_none_of_a_tool_steps_timeout(tokenizer):
    """On-policy RL generates on the event loop's thread (`rl_common.generate_on_training_thread`),
    which blocks the loop for the whole engine call. Turns are synchronous (every env step of a turn
    ends before the next turn's engine call starts), so a call longer than `step_timeout_s` eats
    into no step's time: every episode ends `done`, none `env_error`."""
    from rollout.inference.sampler import EngineSampler

    class SleepyTool(ToolThenAnswer):
        async def step(self, message: Mapping[str, str]) -> StepResult:
            await asyncio.sleep(0.02)
            return await super().step(message)

    replies = {(g, j): [("call", "stop"), ("it is 42", "stop")] for g in (0, 1) for j in range(2)}
    engine = SlowEngine(ScriptedSampler(tokenizer, replies, seed_table(7, [0, 1], 2, 2)), seconds=0.3)
    sampler = EngineSampler(engine, max_batch=8)
    sampler.rounds_on_caller_thread = True
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=200, step_timeout_s=0.2)
    groups = run(sampler, tokenizer, SleepyTool, [(0, {"q": "6*7?"}), (1, {"q": "7*6?"})], n=2, limits=limits)
    episodes = [ep for group in groups for ep in group]
    assert [ep.finish_reason for ep in episodes] == ["done"] * 4 and all(ep.reward == 1.0 for ep in episodes)
    assert engine.threads == [threading.main_thread()] * 2  # one engine call per turn, on the loop's thread
    sampler.close()
