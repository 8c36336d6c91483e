"""RolloutManager on the real hf engine (tiny random model, 4 tokens): groups, rewards, determinism,
resume through JSON, dynamic filtering with carry-over, staleness, and reward failures as data."""

from __future__ import annotations

import asyncio
import json
import statistics
import zlib
from dataclasses import replace

import pytest

from rollout.errors import ConfigError
from rollout.inference.sampler import EngineSampler
from rollout.inference.types import GenerationRequest, SamplingParams, derive_seed
from rollout.rl.buffer import DataBuffer, epoch_order
from rollout.rl.manager import GroupSpec, RolloutManager
from rollout.rl.rewards import arithmetic_correct, format_answer_only

SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)
N = 4


def arithmetic_rows(count: int) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"What is {i}+{i + 1}?"}], "answer": str(2 * i + 1)}
        for i in range(count)
    ]


def make_manager(engine, rows, **overrides) -> RolloutManager:
    group = {"num_generations": N, "sampling": SAMPLING, "seed": 0}
    group.update({k: overrides.pop(k) for k in list(overrides) if k in group or k == "reward_timeout_s"})
    settings = dict(
        reward_fns=[("correct", arithmetic_correct, 1.0), ("format", format_answer_only, 0.5)],
        prompts_per_batch=2,
    )
    settings.update(overrides)
    return RolloutManager(EngineSampler(engine, max_batch=32), rows, DataBuffer(len(rows), seed=group["seed"]),
                          group=GroupSpec(**group), **settings)


def next_batch(manager: RolloutManager, policy_version: int = 0):
    return asyncio.run(manager.next_batch(policy_version))


def same_batches(a, b) -> None:
    assert a.samples == b.samples
    assert a.num_prompts == b.num_prompts and a.policy_version == b.policy_version
    timeless = {k: v for k, v in a.metrics.items() if k != "rollout/generation_s"}
    assert timeless == {k: v for k, v in b.metrics.items() if k != "rollout/generation_s"}


def kind_reward(prompts, completions, kind, **_):
    """Rows say how they are scored: "const" (zero variance), "vary" (a hash of the text), "lonely"
    (only the first completion of the call is scored: one ok sample in its group)."""
    out, seen_lonely = [], False
    for text, k in zip(completions, kind, strict=True):
        if k == "const":
            out.append(1.0)
        elif k == "vary":
            out.append(zlib.crc32(text.encode()) % 1000 / 1000)
        else:
            out.append(None if seen_lonely else 0.5)
            seen_lonely = True
    return out


def kind_rows(kinds: dict[int, str], count: int, *, default: str = "vary") -> list[dict]:
    """Rows whose kind is set by their position in epoch 0's order (seed 0)."""
    order = epoch_order(count, 0, 0)
    rows = arithmetic_rows(count)
    for position, row_index in enumerate(order):
        rows[row_index]["kind"] = kinds.get(position, default)
    return rows


def test_groups_ids_rewards_and_seeds(rl_engine) -> None:
    rows = arithmetic_rows(3)
    events: list[tuple[str, dict]] = []
    manager = make_manager(rl_engine, rows, on_event=lambda name, fields: events.append((name, fields)))
    batch = next_batch(manager, policy_version=7)
    drawn = DataBuffer(3, seed=0).take(4)

    assert batch.num_prompts == 2 and batch.policy_version == 7
    assert [s.group_id for s in batch.samples] == [0] * N + [1] * N
    assert [s.prompt_index for s in batch.samples] == [drawn[0]] * N + [drawn[1]] * N
    for group_id, group in enumerate(batch.groups()):
        row = rows[group[0].prompt_index]
        # choice j of group g is the engine's choice j for seed derive_seed(seed, g): the seeds pin the tokens
        [expected] = rl_engine.generate(
            [
                GenerationRequest(
                    prompt=row["prompt"], params=replace(SAMPLING, n=N, seed=derive_seed(0, group_id))
                )
            ]
        )
        assert [s.completion_token_ids for s in group] == [c.token_ids for c in expected]
        # log-probs: the same to float noise (a group batched with others may take another kernel path
        # on some CPUs; exact equality needs [backend] batch_invariant)
        for s, c in zip(group, expected, strict=True):
            assert s.rollout_logprobs == pytest.approx(c.logprobs, abs=1e-5)
        for s in group:
            assert s.status == "ok" and s.drop_reason is None and s.policy_version == 7
            assert s.prompt == tuple(row["prompt"]) and s.metadata == {"answer": row["answer"]}
            assert s.prompt_token_ids == rl_engine.tokenize(row["prompt"])
            assert 1 <= len(s.completion_token_ids) == len(s.rollout_logprobs) <= 4
            assert s.reward == s.reward_components["correct"] + 0.5 * s.reward_components["format"]
    metrics = batch.metrics
    rewards = [s.reward for s in batch.samples]
    assert metrics["rollout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert metrics["rollout/tokens"] == sum(len(s.completion_token_ids) for s in batch.samples)
    assert {
        "rollout/reward_std",
        "rollout/reward/correct",
        "rollout/reward/format",
        "rollout/generation_s",
        "rollout/completion_len_mean",
    } <= set(metrics)
    assert (metrics["rollout/dropped"], metrics["rollout/filtered_groups_frac"]) == (0.0, 0.0)
    assert events == []

    second = next_batch(manager, policy_version=8)  # the counter and the cursor go on (across the epoch)
    assert [g[0].group_id for g in second.groups()] == [2, 3]
    assert [g[0].prompt_index for g in second.groups()] == drawn[2:4]
    assert manager.totals["batches"] == 2 and manager.totals["groups_generated"] == 4


def test_same_state_same_batches_and_json_resume(rl_engine) -> None:
    rows = arithmetic_rows(3)
    first = make_manager(rl_engine, rows)
    batch_1 = next_batch(first, 0)
    same_batches(batch_1, next_batch(make_manager(rl_engine, rows), 0))  # another manager, same seed

    state = json.loads(json.dumps(first.state_dict()))
    batch_2 = next_batch(first, 1)
    resumed = make_manager(rl_engine, rows)
    resumed.load_state_dict(state)
    same_batches(batch_2, next_batch(resumed, 1))
    assert resumed.state_dict() == first.state_dict()

    other_seed = next_batch(make_manager(rl_engine, rows, seed=1), 0)
    assert other_seed.samples != batch_1.samples


def test_dynamic_filtering_refills_and_carries_groups_over(rl_engine) -> None:
    rows = kind_rows({0: "const"}, 6)  # the first row drawn has zero reward variance
    events: list[tuple[str, dict]] = []
    manager = make_manager(
        rl_engine,
        rows,
        reward_fns=[("kind", kind_reward, 1.0)],
        dynamic_filtering=True,
        on_event=lambda name, fields: events.append((name, fields)),
    )
    batch = next_batch(manager, 0)
    # round 0: groups 0 (const, filtered) and 1; keep rate 1/2 -> round 1 draws 2 rows: groups 2 and 3
    assert [g[0].group_id for g in batch.groups()] == [1, 2]
    assert all(rows[s.prompt_index]["kind"] == "vary" for s in batch.samples)
    assert batch.metrics["rollout/rounds"] == 2
    assert batch.metrics["rollout/filtered_groups_frac"] == 0.25
    assert batch.metrics["rollout/carried_out"] == 1
    # the trained batch's mean reward leaves the filtered group out; the generated mean does not
    generated = [s.reward for s in batch.samples] + [1.0] * N + [s.reward for g in manager._carried for s in g]
    assert batch.metrics["rollout/reward_mean"] == statistics.fmean(s.reward for s in batch.samples)
    assert batch.metrics["rollout/reward_mean_generated"] == pytest.approx(statistics.fmean(generated), abs=1e-12)
    assert events == [("groups_filtered", {"count": 1, "zero_std": 1})]
    assert [g[0]["group_id"] for g in manager.state_dict()["carried"]] == [3]

    state = json.loads(json.dumps(manager.state_dict()))
    following = next_batch(manager, 0)
    assert [g[0].group_id for g in following.groups()] == [3, 4]  # the carried group comes first
    assert following.metrics["rollout/carried_in"] == 1 and following.metrics["rollout/rounds"] == 1
    resumed = make_manager(rl_engine, rows, reward_fns=[("kind", kind_reward, 1.0)], dynamic_filtering=True)
    resumed.load_state_dict(state)
    same_batches(following, next_batch(resumed, 0))


def test_dynamic_filtering_drops_groups_of_identical_completions(rl_engine) -> None:
    """Greedy sampling makes a group's completions identical; a noisy scorer (0 and 1 by position,
    whatever the text) still spreads their rewards. Such a group is dropped ("identical": its
    advantages would be the scorer's noise); without dynamic filtering it trains."""
    def noisy(prompts, completions, **_):
        return [float(i % 2) for i in range(len(completions))]

    greedy = replace(SAMPLING, temperature=0.0)
    events: list[tuple[str, dict]] = []
    manager = make_manager(rl_engine, arithmetic_rows(4), reward_fns=[("noisy", noisy, 1.0)], sampling=greedy,
                           dynamic_filtering=True, max_oversample_rounds=1,
                           on_event=lambda name, fields: events.append((name, fields)))
    batch = next_batch(manager, 0)
    assert batch.samples == () and batch.metrics["rollout/filtered_groups_frac"] == 1.0
    assert batch.metrics["rollout/reward_mean_generated"] == 0.5  # the scorer did spread them
    (name, fields), *rest = events
    assert name == "groups_filtered" and fields["count"] == fields["identical"] >= 2 and set(fields) == {
        "count", "identical"}
    assert [name for name, _ in rest] == ["batch_short"]
    kept = next_batch(make_manager(rl_engine, arithmetic_rows(4), reward_fns=[("noisy", noisy, 1.0)],
                                   sampling=greedy), 0)
    assert len(kept.groups()) == 2
    assert all(len({s.completion_token_ids for s in g}) == 1 for g in kept.groups())


def test_stale_carried_groups_are_discarded(rl_engine) -> None:
    rows = kind_rows({0: "const"}, 6)
    settings = dict(reward_fns=[("kind", kind_reward, 1.0)], dynamic_filtering=True)
    events: list[tuple[str, dict]] = []
    strict = make_manager(rl_engine, rows, **settings, on_event=lambda n, f: events.append((n, f)))
    next_batch(strict, 0)  # carries group 3 (policy version 0)
    batch = next_batch(strict, 1)
    assert [g[0].group_id for g in batch.groups()] == [4, 5]
    assert batch.metrics["rollout/stale_dropped"] == 1 and batch.metrics["rollout/carried_in"] == 0
    assert ("stale_dropped", {"groups": 1, "policy_version": 1}) in events

    lenient = make_manager(rl_engine, rows, **settings, max_staleness=1)
    next_batch(lenient, 0)
    batch = next_batch(lenient, 1)
    assert [(g[0].group_id, g[0].policy_version) for g in batch.groups()] == [(3, 0), (4, 1)]
    assert batch.policy_version == 0 and batch.metrics["rollout/stale_dropped"] == 0


def test_groups_with_one_ok_sample(rl_engine) -> None:
    rows = kind_rows({0: "lonely"}, 2)
    fns = [("kind", kind_reward, 1.0)]
    events: list[tuple[str, dict]] = []
    filtering = make_manager(
        rl_engine,
        rows,
        reward_fns=fns,
        prompts_per_batch=1,
        dynamic_filtering=True,
        max_oversample_rounds=0,
        on_event=lambda n, f: events.append((n, f)),
    )
    batch = next_batch(filtering, 0)  # its only round gives one usable sample: no group, a short batch
    assert batch.num_prompts == 0 and batch.samples == ()
    assert "rollout/reward_mean" not in batch.metrics and batch.metrics["rollout/dropped"] == 3
    assert [name for name, _ in events] == ["samples_dropped", "groups_filtered", "batch_short"]
    assert events[1][1] == {"count": 1, "too_few_ok": 1}
    assert events[2][1] == {"groups": 0, "wanted": 1, "rounds": 1}

    plain = make_manager(rl_engine, rows, reward_fns=fns, prompts_per_batch=1)
    batch = next_batch(plain, 0)  # without filtering the group stays, its dropped samples marked
    [group] = batch.groups(ok_only=False)
    assert [s.status for s in group] == ["ok", "dropped", "dropped", "dropped"]
    assert group[1].drop_reason == "all reward functions abstained" and group[1].reward is None
    assert len(batch.groups()) == 1 and len(batch.groups()[0]) == 1
    assert batch.metrics["rollout/dropped"] == 3 and batch.metrics["rollout/reward_mean"] == 0.5


def test_a_failing_reward_function_drops_samples_and_the_run_goes_on(rl_engine) -> None:
    calls = []

    def flaky(prompts, completions, answer, **_):
        calls.append(len(completions))
        if len(calls) == 1:
            raise RuntimeError("grader offline")
        return [float(len(c) % 2) for c in completions]

    events: list[tuple[str, dict]] = []
    manager = make_manager(
        rl_engine,
        arithmetic_rows(3),
        reward_fns=[("flaky", flaky, 1.0)],
        on_event=lambda n, f: events.append((n, f)),
    )
    batch = next_batch(manager, 0)
    reason = "reward fn flaky raised RuntimeError: grader offline"
    assert events[0] == ("samples_dropped", {"count": 2 * N, "reasons": {reason: 2 * N}, "policy_version": 0})
    assert events[1] == ("groups_filtered", {"count": 2, "all_dropped": 2})
    # round 1 over-samples 4x (keep rate 0 so far): 8 groups, 2 in the batch, 6 carried
    assert calls == [2 * N, 8 * N]
    assert batch.num_prompts == 2 and all(s.ok for s in batch.samples)
    assert [g[0].group_id for g in batch.groups()] == [2, 3]
    assert batch.metrics["rollout/dropped"] == 2 * N and batch.metrics["rollout/carried_out"] == 6
    assert manager.totals["samples_dropped"] == 2 * N
    following = next_batch(manager, 0)  # no round needed: the carried groups fill it
    assert [g[0].group_id for g in following.groups()] == [4, 5]
    assert following.metrics["rollout/rounds"] == 0 and following.metrics["rollout/tokens"] == 0
    assert following.metrics["rollout/carried_in"] == 6 and following.metrics["rollout/carried_out"] == 4


def test_invalid_settings_are_config_errors(rl_engine) -> None:
    rows = arithmetic_rows(3)
    with pytest.raises(ConfigError, match="dynamic_filtering needs num_generations >= 2"):
        make_manager(rl_engine, rows, num_generations=1, dynamic_filtering=True)
    with pytest.raises(ConfigError, match="reward function names must be unique"):
        make_manager(
            rl_engine, rows, reward_fns=[("a", arithmetic_correct, 1.0), ("a", format_answer_only, 1.0)]
        )
    with pytest.raises(ConfigError, match="the data buffer has 4 rows but the dataset has 3"):
        RolloutManager(
            EngineSampler(rl_engine, max_batch=32),
            rows,
            DataBuffer(4, seed=0),
            reward_fns=[("a", arithmetic_correct, 1.0)],
            group=GroupSpec(2, SAMPLING, seed=0),
            prompts_per_batch=1,
        )
    manager = make_manager(rl_engine, rows)
    with pytest.raises(ConfigError, match="state has version"):
        manager.load_state_dict({"version": 99})
