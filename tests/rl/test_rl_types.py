"""Sample / RolloutBatch: JSON round trip and grouping."""

from __future__ import annotations

import json

import pytest

from rollout.rl.types import RolloutBatch, Sample, TokenSegment, Trajectory


def make_sample(group_id: int, reward: float | None, **overrides) -> Sample:
    fields = dict(
        prompt_index=3,
        group_id=group_id,
        prompt=[{"role": "user", "content": "What is 3+8?"}],
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_text="11",
        rollout_logprobs=[-0.5, -1.25],
        finish_reason="stop",
        reward=reward,
        reward_components={"correct": reward, "format": None},
        status="ok" if reward is not None else "dropped",
        policy_version=2,
        metadata={"answer": "11", "tags": ["a"]},
        drop_reason=None if reward is not None else "reward fn correct raised ValueError: x",
    )
    fields.update(overrides)
    return Sample(**fields)


@pytest.mark.parametrize("reward", [1.0, None])
def test_sample_round_trips_through_json(reward: float | None) -> None:
    sample = make_sample(0, reward)
    assert isinstance(sample.prompt, tuple)
    assert sample.prompt_token_ids == (1, 2, 3)
    again = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert again == sample
    unlikely = make_sample(0, reward, rollout_logprobs=[-0.5, float("-inf")])  # JSON has no inf
    assert Sample.from_dict(json.loads(json.dumps(unlikely.to_dict(), allow_nan=False))) == unlikely
    text = make_sample(0, reward, prompt="What is 1+1?")
    assert Sample.from_dict(json.loads(json.dumps(text.to_dict()))) == text


def test_sample_checks_its_invariants() -> None:
    with pytest.raises(ValueError, match="2 log-probs for 3 completion tokens"):
        make_sample(0, 1.0, completion_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="reward exactly when"):
        make_sample(0, None, status="ok")


def test_batch_groups_skip_dropped_samples() -> None:
    samples = (make_sample(0, 1.0), make_sample(0, None), make_sample(1, 0.0), make_sample(2, None))
    batch = RolloutBatch(samples=samples, num_prompts=3, policy_version=2, metrics={})
    assert [len(g) for g in batch.groups()] == [1, 1]
    assert [len(g) for g in batch.groups(ok_only=False)] == [2, 1, 1]
    assert [s.reward for s in batch.ok_samples()] == [1.0, 0.0]


@pytest.mark.parametrize("reward", [1.0, None])
def test_a_sample_is_a_single_turn_trajectory_exactly(reward: float | None) -> None:
    sample = make_sample(0, reward)
    t = sample.trajectory()
    assert t.single_turn() == (sample.prompt_token_ids, sample.completion_token_ids, sample.rollout_logprobs)
    assert t.token_ids == (1, 2, 3, 4, 5) and t.loss_mask == (False, False, False, True, True)
    assert t.num_turns == 1 and t.text == "11" and t.finish_reason == "stop"
    assert (t.reward, t.turn_rewards) == ((1.0, (1.0,)) if reward is not None else (None, ()))


def test_trajectory_segments_carry_their_source() -> None:
    t = Trajectory(
        segments=(
            TokenSegment("prompt", [1, 2]),
            TokenSegment("sampled", [3], [-0.1]),
            TokenSegment("tool", [4, 5], turn=0),
            TokenSegment("sampled", [6, 7], [-0.2, -0.3], turn=1),
        ),
        turn_rewards=[0.0, 1.0], reward=1.0, finish_reason="stop", text="a b",
    )
    assert t.loss_mask == (False, False, True, False, False, True, True)
    assert t.num_turns == 2
    with pytest.raises(ValueError, match="not a single-turn"):
        t.single_turn()
    with pytest.raises(ValueError, match="exactly when its tokens were sampled"):
        TokenSegment("env", [1], [-0.5])
    with pytest.raises(ValueError, match="2 log-probs for 1 sampled tokens"):
        TokenSegment("sampled", [1], [-0.5, -0.5])
