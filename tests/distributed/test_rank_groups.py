"""The torchrun ranks' group exchange without a process group: the tensor encoding of groups
round-trips every field exactly (multi-turn masks, episodes, -inf log-probs, dropped samples),
and the shares of a round and of a micro-batch cover it once.

    .venv/bin/pytest tests/distributed/test_rank_groups.py -q
"""

from __future__ import annotations

import math

import torch

from rollout.algorithms.grpo import rank_rows
from rollout.distributed import Distributed
from rollout.rl.torchrun_rollout import decode_groups, encode_groups, exchange_groups, rank_share
from rollout.rl.types import Sample


def _sample(group_id: int, **changes) -> Sample:
    fields = dict(
        prompt_index=3, group_id=group_id, prompt="1+2=", prompt_token_ids=(5, 6, 7), completion_token_ids=(8, 9),
        completion_text="3 ✓", rollout_logprobs=(-0.1234567890123, -math.inf), finish_reason="stop", reward=0.1 + 0.2,
        reward_components={"correct": 0.30000000000000004, "abstained": None}, status="ok", policy_version=2,
        metadata={"answer": "3", "tags": ["a", 1]},
    )
    return Sample(**(fields | changes))


def test_groups_round_trip_through_tensors():
    multi_turn = _sample(
        8, prompt=({"role": "user", "content": "guess"},), completion_token_ids=(1, 2, 3, 4),
        rollout_logprobs=(-1.5, 0.0, 0.0, -2.25), completion_mask=(True, False, False, True),
        turn_rewards=(0.0, 1.0), reward=1.0, episode={"turns": 2, "env_error": None},
    )
    dropped = _sample(7, reward=None, status="dropped", drop_reason="timeout", reward_components={"correct": None})
    groups = [(_sample(7), dropped), (multi_turn,), (_sample(9, completion_token_ids=(), rollout_logprobs=()),)]
    ids, logps, header = encode_groups(groups)
    assert (ids.dtype, logps.dtype, header.dtype) == (torch.int64, torch.float64, torch.uint8)
    assert decode_groups(ids, logps, header) == groups
    assert decode_groups(*encode_groups([])) == []
    assert exchange_groups(groups, Distributed()) == [groups]  # one process: its own groups, decoded


def test_shares_cover_a_round_once():
    for n in range(9):
        for world in (1, 2, 3):
            shares = [rank_share(n, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_a_rank_without_rows_runs_one_that_counts_nothing():
    ranks = [Distributed(rank=r, world_size=3, sharding="ddp") for r in range(3)]
    assert [rank_rows([4, 9, 11, 12], d) for d in ranks] == [([4, 9], [True, True]), ([11], [True]), ([12], [True])]
    assert [rank_rows([4], d) for d in ranks] == [([4], [True]), ([4], [False]), ([4], [False])]
