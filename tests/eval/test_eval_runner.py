"""`run_eval`, the async sampler and the eval harness, in-process (fake engines, stub envs, a faulty endpoint)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from eval_fakes import CountdownEnv, FaultyEndpoint, SeedAnswerEnv, SeedEchoEngine

from rollout.errors import RolloutError
from rollout.eval.config import EvalConfig
from rollout.eval.harness import (
    EvalData,
    check_resume,
    create_eval_record,
    execute_eval,
    load_engine,
    resolve_target,
)
from rollout.eval.metrics import pass_at_k, summarize
from rollout.eval.runner import run_eval, summarize_samples, to_outcome
from rollout.inference.sampler import EngineSampler, RetryPolicy
from rollout.inference.types import SamplingParams, derive_seed
from rollout.store import open_store

PARAMS = SamplingParams(temperature=1.0, max_tokens=4)
ROWS = [{"prompt": f"What is {i}?", "answer": str(i % 5)} for i in range(7)]


def run(sampler, env, rows, **kw):
    return asyncio.run(run_eval(sampler, env, rows, params=PARAMS, **kw))


def without_times(samples):
    return [replace(s, created_at=0.0) for s in samples]


def test_seeds_rewards_and_metrics_do_not_depend_on_batching():
    engine = SeedEchoEngine()
    big = run(EngineSampler(engine, max_batch=64), SeedAnswerEnv, ROWS, n=6, seed=3, ks=[1, 2, 6])
    assert max(engine.batch_sizes) == 42  # every episode's first turn went in one generate call
    one_by_one = run(
        EngineSampler(SeedEchoEngine(), max_batch=1, max_in_flight=3), SeedAnswerEnv, ROWS, n=6, seed=3,
        ks=[1, 2, 6], max_active=5,
    )  # fmt: skip
    assert without_times(big.samples) == without_times(one_by_one.samples)
    assert big.summary == one_by_one.summary

    s = big.samples[13]  # prompt 2, sample 1
    assert (s.prompt_index, s.sample_index, s.seed) == (2, 1, derive_seed(3, 2, 1))
    assert s.completion == str(s.seed % 5) == s.answer
    assert s.reward == (1.0 if s.completion == "2" else 0.5 if s.completion == "4" else 0.0)
    assert s.success == (s.reward >= 1.0) and s.messages[-1] == {"role": "assistant", "content": s.completion}
    assert (s.turns, s.prompt_tokens, s.completion_tokens, s.finish_reason) == (1, 3, 1, "stop")

    # pass@k by hand for prompt 0 (answer "0") matches the estimator the summary averages.
    successes = sum(x.success for x in big.samples if x.prompt_index == 0)
    per_prompt = [
        pass_at_k(6, sum(x.success for x in big.samples if x.prompt_index == p), 2) for p in range(7)
    ]
    assert big.summary.metrics["pass@2"] == pytest.approx(sum(per_prompt) / 7, abs=0)
    assert 0 <= successes <= 6 and 0 < big.summary.metrics["pass@6"] < 1  # not a degenerate eval
    assert big.summary.metrics["mean_reward"] > big.summary.metrics["pass@1"]  # the 0.5 rewards count


def test_previous_samples_are_kept_and_only_missing_pairs_run():
    full = run(EngineSampler(SeedEchoEngine(), max_batch=8), SeedAnswerEnv, ROWS, n=4, seed=1)
    kept = full.samples[::3]
    engine = SeedEchoEngine()
    resumed = run(EngineSampler(engine, max_batch=8), SeedAnswerEnv, ROWS, n=4, seed=1, previous=kept)
    assert sum(engine.batch_sizes) == len(full.samples) - len(kept)
    assert without_times(resumed.samples) == without_times(full.samples) and resumed.summary == full.summary


def test_samples_reach_the_sink_in_batches():
    batches: list[int] = []
    result = run(
        EngineSampler(SeedEchoEngine(), max_batch=16), SeedAnswerEnv, ROWS * 20, n=1, seed=0,
        on_samples=lambda batch: batches.append(len(batch)),
    )  # fmt: skip
    assert sum(batches) == len(result.samples) == 140 and max(batches) <= 64 and len(batches) >= 3


def test_multi_turn_episodes_go_back_through_the_chat_api():
    rows = [{"prompt": "go", "steps": 3}, {"prompt": "go", "steps": 9}]
    result = run(EngineSampler(SeedEchoEngine(), max_batch=8), CountdownEnv, rows, n=2, seed=5, max_turns=4)
    done, cut = result.samples[0], result.samples[2]
    assert (done.turns, done.reward, done.truncated, done.finish_reason) == (3, 0.75, False, "stop")
    assert [m["role"] for m in done.messages] == [
        "system", "user", "assistant", "tool", "user", "assistant", "tool", "user", "assistant",
    ]  # fmt: skip
    # Turn t > 0 samples with derive_seed(sample_seed, t): the fake engine echoes seed % 5.
    assistant = [m["content"] for m in done.messages if m["role"] == "assistant"]
    assert assistant == [str(done.seed % 5), *(str(derive_seed(done.seed, t) % 5) for t in (1, 2))]
    assert (done.tool_calls, done.prompt_tokens, done.completion_tokens) == (2, 9, 3)
    assert done.answer == assistant[-1] and done.completion == assistant[-1]
    assert (cut.turns, cut.reward, cut.truncated, cut.finish_reason) == (4, 1.0, True, "max_turns")


def test_a_failing_batch_is_split_and_only_the_bad_request_fails():
    engine = SeedEchoEngine()
    rows = [
        {"prompt": "fine", "answer": "1"},
        {"prompt": "poison", "answer": "1"},
        {"prompt": "ok", "answer": "2"},
    ]
    sampler = EngineSampler(engine, max_batch=8, retry=RetryPolicy(max_attempts=2, backoff_s=0.001))
    result = run(sampler, SeedAnswerEnv, rows, n=2, seed=0)
    failed = [s for s in result.samples if s.failed]
    assert [(s.prompt_index, s.failed) for s in result.samples].count((1, True)) == 2 == len(failed)
    assert all("poisoned" in s.error and "after 2 attempts" in s.error for s in failed)
    assert all(s.reward is None and not s.success and s.answer is None and s.turns == 0 for s in failed)
    assert failed[0].messages == [{"role": "user", "content": "poison"}] and failed[0].finish_reason is None
    assert result.summary.metrics["n_failed"] == 2 and sampler.retries == 2
    assert engine.batch_sizes[0] == 6  # one batch first; then the survivors and the poisoned ones alone


def test_env_errors_stop_the_eval():
    class NanEnv(SeedAnswerEnv):
        async def step(self, assistant_message):
            return replace(await super().step(assistant_message), reward=float("nan"))

    with pytest.raises(RolloutError, match="non-finite reward"):
        run(EngineSampler(SeedEchoEngine(), max_batch=4), NanEnv, ROWS, n=1, seed=0)
    with pytest.raises(KeyError):  # a row without "answer": the env's own error, not swallowed
        run(EngineSampler(SeedEchoEngine(), max_batch=4), SeedAnswerEnv, [{"prompt": "x"}], n=1, seed=0)


def test_harness_stores_every_sample_and_output_rows_recompute_the_summary(tmp_path: Path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    data = EvalData(tmp_path / "data.jsonl", "d" * 64, ROWS)
    cfg = EvalConfig(env="eval_fakes:SeedAnswerEnv", model=str(tmp_path), n=8, k=[1, 2, 4, 8], seed=11)
    target = resolve_target_stub()
    record = create_eval_record(store, cfg, target, data)
    summary = execute_eval(store, record, cfg, SeedEchoEngine(), data, output=tmp_path / "rows.jsonl")

    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
        (p, s) for p in range(7) for s in range(8)
    ]
    assert {r["eval_id"] for r in rows} == {record.id}
    recomputed = summarize([to_outcome(r) for r in rows], ks=[1, 2, 4, 8], seed=11)
    stored = store.get_eval(record.id)
    assert recomputed.metrics == summary.metrics == stored.summary["metrics"]  # exactly, CIs included
    assert list(stored.summary["metrics"]) == list(summary.metrics)  # and in the same order
    assert stored.status == "succeeded" and stored.timings["sessions"] == 1
    assert summarize_samples(store.read_eval_samples(record.id), ks=cfg.k, seed=11) == summary

    # Resuming a finished eval generates nothing and gives the same numbers.
    again = execute_eval(
        store, store.get_eval(record.id), cfg, None, data, previous=store.read_eval_samples(record.id)
    )
    assert again == summary and store.get_eval(record.id).timings["sessions"] == 2
    store.close()


def resolve_target_stub():
    from rollout.eval.harness import Target

    return Target("hf", "seed-echo", "files:stub")


def test_resume_refuses_other_data_or_another_model(tmp_path: Path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    cfg = EvalConfig(env="arithmetic", model=str(tmp_path))
    record = create_eval_record(
        store, cfg, resolve_target_stub(), EvalData(tmp_path / "d.jsonl", "a" * 64, ROWS)
    )
    with pytest.raises(RolloutError, match="the data changed since eval"):
        check_resume(record, EvalData(tmp_path / "d.jsonl", "b" * 64, ROWS), resolve_target_stub())
    with pytest.raises(RolloutError, match="the model changed"):
        check_resume(
            record,
            EvalData(tmp_path / "d.jsonl", "a" * 64, ROWS),
            replace(resolve_target_stub(), identity="x"),
        )
    store.close()


def test_faulty_endpoint_samples_are_retried_then_failed_and_the_eval_finishes(tmp_path: Path):
    """Errors and timeouts are retried with backoff; what keeps failing is a counted, failed sample."""
    from contextlib import ExitStack

    rows = [{"prompt": p} for p in ("fine", "flaky", "always-500", "slow", "fine too")]
    store = open_store("embedded", path=tmp_path / "rollout.db")
    with FaultyEndpoint(slow_s=3.0) as endpoint, ExitStack() as stack:
        cfg = EvalConfig(
            env="eval_fakes:HashEnv", base_url=endpoint.base_url, n=2, max_attempts=3, retry_backoff_s=0.01,
            request_timeout_s=1.0, max_concurrency=4,
        )  # fmt: skip
        target = resolve_target(cfg, api_key=None, store=store, object_path=None)
        assert (target.served_model, target.identity) == ("stub", f"openai:{endpoint.base_url}:stub")
        engine = load_engine(target, cfg, stack)
        data = EvalData(tmp_path / "d.jsonl", "c" * 64, rows)
        record = create_eval_record(store, cfg, target, data)
        summary = execute_eval(store, record, cfg, engine, data)

    samples = store.read_eval_samples(record.id)
    by_prompt = {p: [s for s in samples if s.prompt_index == p] for p in range(5)}
    assert not any(s.failed for p in (0, 1, 3, 4) for s in by_prompt[p])  # flaky and slow recovered
    assert all(s.completion == f"ok {s.seed % 3}" for p in (0, 1, 3, 4) for s in by_prompt[p])
    assert all(s.failed and "gave up after 3 attempts" in s.error for s in by_prompt[2])
    assert all(endpoint.tries[("flaky", s.seed)] == 3 for s in by_prompt[1])  # 2 errors, then the answer
    assert all(endpoint.tries[("always-500", s.seed)] == 3 for s in by_prompt[2])
    assert all(endpoint.tries[("slow", s.seed)] == 2 for s in by_prompt[3])  # a timeout, then the answer
    assert summary.metrics["n_failed"] == 2 and summary.n_samples == 10
    stored = store.get_eval(record.id)
    assert stored.status == "succeeded" and stored.timings["retries"] == 2 * 2 + 2 * 2 + 2 * 1
    store.close()


class ToolUsingEngine:
    """Calls the calculator when the conversation has no tool result yet, then repeats the result.
    Records the tools each request carried (what the chat template / endpoint receives)."""

    model_name = "tool-user"
    weights_version = 0

    def __init__(self) -> None:
        self.tools_seen: list[object] = []

    def generate(self, requests, params=None):
        from rollout.inference.types import Completion, as_request

        out = []
        for r in map(as_request, requests):
            self.tools_seen.append(r.tools)
            tool = [m for m in r.prompt if m["role"] == "tool"]
            if tool:
                text = f"The answer is {tool[-1]['content']}."
            else:
                question = r.prompt[-1]["content"].removeprefix("What is ").rstrip("?")
                text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{question}"}}}}</tool_call>'
            out.append((Completion(0, text, (7,), (-0.5,), "stop", 3, 1),))
        return out

    def update_weights(self, weights):
        raise NotImplementedError

    def close(self):
        pass


def test_a_tool_env_gets_its_tools_rendered_and_its_calls_run():
    from rollout.rl.calculator_env import CalculatorEnv
    from rollout.tasks.calculator import calculator_tool

    engine = ToolUsingEngine()
    rows = [{"prompt": [{"role": "user", "content": "What is 123*45?"}], "answer": "5535"}]
    result = run(EngineSampler(engine, max_batch=8), CalculatorEnv, rows, n=2, seed=0, max_turns=3)
    assert [(s.reward, s.turns, s.tool_calls, s.answer) for s in result.samples] == [(1.0, 2, 1, "5535")] * 2
    schema = calculator_tool().openai_schema()
    assert engine.tools_seen and all(t == (schema,) for t in engine.tools_seen)
