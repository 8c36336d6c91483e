"""Rollout on torchrun ranks: `[distributed] kind = "torchrun"` for GRPO.

    [distributed]
    kind = "torchrun"
    nproc_per_node = 2

Every rank runs the same `RolloutManager` (the data buffer, group ids, filtering and carried
groups are deterministic, so the managers stay in step) with `RankGroups` as its group runner:
of each round's groups, rank r makes its contiguous share with `generate_groups` on its own hf
engine (the function a local run calls), then the ranks exchange their groups
(`exchange_groups`), so every rank holds the round exactly as one process would have made it.
Dynamic sampling, advantages, the loss normaliser and the metrics are then computed from the
same batch on every rank; each rank trains on its slice of it (`rollout.algorithms.grpo`).

Determinism. The engines are batch-invariant (`BATCH_INVARIANT_PAD`, as Ray's workers): a
group's tokens and log-probs do not depend on the other requests of an engine call, and its
sampling seeds are keyed by (seed, group id, choice), so which rank makes a group does not
change it. A `kind = "local"` run with `[backend] batch_invariant = true` samples the same
groups from the same weights.

The exchange is torch.distributed collectives on tensors (no pickle): the token ids (prompt,
completion, and a multi-turn sample's completion mask) as one int64 tensor, the engine's
log-probs as one float64 tensor, and each sample's other fields (text, rewards, metadata,
episode) as the UTF-8 JSON of `Sample.to_dict` without those lists; JSON keeps every float
exactly (a snapshot's pending batch uses the same encoding).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout.rl.manager import Group, GroupSpec, RoundItem, generate_groups
from rollout.rl.types import RewardSpec, Sample

if TYPE_CHECKING:
    import torch

    from rollout.distributed import Distributed
    from rollout.inference.sampler import RequestSampler
    from rollout.rl.episode import EpisodeSetup

_ARRAYS = ("prompt_token_ids", "completion_token_ids", "rollout_logprobs", "completion_mask")


def rank_share(n: int, rank: int, world_size: int) -> range:
    """The positions rank `rank` makes of a round of `n` groups: a contiguous share, the first
    `n % world_size` ranks one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class RankGroups:
    """The manager's `GroupRunner` on a torchrun rank: this rank's share of a round made here,
    every rank's share gathered."""

    def __init__(
        self, sampler: RequestSampler, spec: GroupSpec, *, reward_fns: Sequence[RewardSpec],
        episodes: EpisodeSetup | None, dist: Distributed,
    ) -> None:
        self.sampler = sampler
        self.spec = spec
        self.reward_fns = tuple(reward_fns)
        self.episodes = episodes
        self.dist = dist
        self._groups = [0] * dist.world_size
        self._busy_s = [0.0] * dist.world_size

    async def run_groups(self, items: Sequence[RoundItem], policy_version: int) -> list[Group]:
        """The round's groups in the order of `items` (every rank calls it with the same items)."""
        import torch

        mine = [items[i] for i in rank_share(len(items), self.dist.rank, self.dist.world_size)]
        started = time.perf_counter()
        groups: list[Group] = []
        if mine:
            groups, _ = await generate_groups(
                self.sampler, mine, self.spec, reward_fns=self.reward_fns, episodes=self.episodes,
                policy_version=policy_version,
            )
        busy = time.perf_counter() - started
        by_rank = exchange_groups(groups, self.dist)
        times = self.dist.all_gather_1d(torch.tensor([busy], dtype=torch.float64))
        for rank, (share, seconds) in enumerate(zip(by_rank, times, strict=True)):
            self._groups[rank] += len(share)
            self._busy_s[rank] += float(seconds[0])
        out = [group for share in by_rank for group in share]
        assert [g[0].group_id for g in out] == [gid for _, _, gid in items], "the ranks made other groups"
        return out

    def take_metrics(self) -> dict[str, float]:
        """Groups made and seconds spent per rank since the last call."""
        metrics: dict[str, float] = {}
        for rank in range(self.dist.world_size):
            metrics[f"rollout/rank/{rank}/groups"] = float(self._groups[rank])
            metrics[f"rollout/rank/{rank}/busy_s"] = self._busy_s[rank]
        self._groups = [0] * self.dist.world_size
        self._busy_s = [0.0] * self.dist.world_size
        return metrics


def exchange_groups(groups: Sequence[Group], dist: Distributed) -> list[list[Group]]:
    """Every rank's `groups`, by rank, on every rank (decoded the same way on each, this rank's
    own included, so all ranks hold equal samples)."""
    ids, logps, header = encode_groups(groups)
    all_ids, all_logps, all_headers = (dist.all_gather_1d(t) for t in (ids, logps, header))
    return [decode_groups(*parts) for parts in zip(all_ids, all_logps, all_headers, strict=True)]


def encode_groups(groups: Sequence[Group]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int64 token ids and masks, float64 log-probs, uint8 JSON of the rest) of `groups`."""
    import torch

    ids: list[int] = []
    logps: list[float] = []
    header: list[list[dict[str, Any]]] = []
    for group in groups:
        rows = []
        for sample in group:
            mask = sample.completion_mask
            ids += [*sample.prompt_token_ids, *sample.completion_token_ids, *(int(m) for m in mask or ())]
            logps += sample.rollout_logprobs
            fields = {k: v for k, v in sample.to_dict().items() if k not in _ARRAYS}
            rows.append({**fields, "lengths": [len(sample.prompt_token_ids), len(sample.completion_token_ids)],
                         "masked": mask is not None})
        header.append(rows)
    data = json.dumps(header, allow_nan=True).encode()
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(logps, dtype=torch.float64),
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8))


def decode_groups(ids: torch.Tensor, logps: torch.Tensor, header: torch.Tensor) -> list[Group]:
    """`encode_groups` inverted."""
    all_ids, all_logps = ids.tolist(), logps.tolist()
    at = lp = 0
    groups: list[Group] = []
    for rows in json.loads(header.numpy().tobytes().decode()):
        samples = []
        for row in rows:
            n_prompt, n_completion = row.pop("lengths")
            masked = row.pop("masked")
            row["prompt_token_ids"] = all_ids[at : at + n_prompt]
            row["completion_token_ids"] = all_ids[at + n_prompt : at + n_prompt + n_completion]
            at += n_prompt + n_completion
            if masked:
                row["completion_mask"] = all_ids[at : at + n_completion]
                at += n_completion
            row["rollout_logprobs"] = all_logps[lp : lp + n_completion]
            lp += n_completion
            samples.append(Sample.from_dict(row))
        groups.append(tuple(samples))
    assert at == len(all_ids) and lp == len(all_logps), "a rank's groups did not decode"
    return groups
