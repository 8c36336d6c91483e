"""A trained reward model as an RL reward: `[[algorithm.<grpo|ppo>.rewards]] kind = "reward_model"`.

    [[algorithm.ppo.rewards]]
    kind = "reward_model"
    model = "../local/models/rm-tiny"     # an export of `rollout train rm`; or snapshot = "<id>"
    weight = 1.0
    normalize = "group"                   # none | group | batch | running

    rm = load_reward_model("local/models/rm-tiny", device=torch.device("cpu"))
    scores = rm(prompts, completions)     # a RewardFn: one float per completion

The RM is loaded once per run, in eval mode with gradients off, beside the
policy (one extra model in memory). Each completion is formatted exactly as
`rollout train rm` formatted its pairs, with the RM's own tokenizer: a chat
prompt plus `{"role": "assistant", "content": completion}` through the RM's
chat template, a text prompt as `ids(prompt) + ids(completion) + [eos]`
(`tokenize_sft(loss_on="full")` renders both exactly as `tokenize_pairs`
renders a side of a pair), first `max_seq_len` tokens kept. The score is the
1-logit head on the last token (`rollout.algorithms.rm.score_sequences`),
computed in batches of `batch_size` rows sorted by length (less padding).

It is a plain synchronous reward function: `score_batch` runs it in its own
thread under `reward_timeout_s` (a timeout drops the batch's samples, like any
reward failure), so the forward pass never blocks the event loop.

Metrics: `rollout/reward/<name>` is the RM's raw score. With a normalisation,
the normalised score is a second reward `<name>_<normalize>` (metric
`rollout/reward/rm_group`, say) that carries the weight, and the raw one is
logged with weight 0; both come from one forward pass (`score` remembers the
last batch). Normalisations:
  none     the raw score
  group    s minus the mean score of the completions of the same prompt scored with it (a
           per-prompt baseline, as in RLOO / GRPO): an RM's scores carry a large per-prompt
           offset that a 0/1 checker's don't, and PPO's critic learns it only slowly
  batch    (s - mean) / (std + eps) over the completions scored together (one manager round)
  running  the same with the mean/std of every score seen so far, this batch included
           (Chan et al.'s parallel update); the moments are part of the RL snapshot, so a
           resumed run normalises exactly as the uninterrupted one.

A served RM: `rollout serve --model <RM export>` answers `POST /v1/rewards`
(`rollout.serve.reward_app`) with these same raw scores, and an entry with `url
= "http://host:port/v1"` scores there (`rollout.rl.served_reward`), normalised
here exactly as in process.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollout.data.jsonl import Row
from rollout.errors import ConfigError, ModelError
from rollout.inference.types import Prompt

Normalize = Literal["none", "group", "batch", "running"]
EPS = 1e-6


# --- normalisation (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations (M2) of every score seen."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def update(self, values: Sequence[float]) -> Moments:
        """These moments merged with `values`' (Chan, Golub & LeVeque, 1979)."""
        if not values:
            return self
        n = len(values)
        mean = math.fsum(values) / n
        m2 = math.fsum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        return Moments(
            count=total,
            mean=self.mean + delta * n / total,
            m2=self.m2 + m2 + delta * delta * self.count * n / total,
        )


def normalize_scores(
    scores: Sequence[float], mode: Normalize, moments: Moments, groups: Sequence[Hashable] | None = None
) -> tuple[list[float], Moments]:
    """(normalised scores, moments after this batch). `moments` only change under "running";
    "group" subtracts the mean score of each score's group (`groups[i]`, e.g. its prompt)."""
    if mode == "none":
        return list(scores), moments
    if mode == "group":
        keys = groups if groups is not None else [0] * len(scores)
        if len(keys) != len(scores):
            raise ValueError(f"{len(keys)} group keys for {len(scores)} scores")
        members: dict[Hashable, list[float]] = {}
        for key, s in zip(keys, scores, strict=True):
            members.setdefault(key, []).append(s)
        means = {key: math.fsum(v) / len(v) for key, v in members.items()}
        return [s - means[key] for key, s in zip(keys, scores, strict=True)], moments
    if mode == "batch":
        stats = Moments().update(scores)
    elif mode == "running":
        stats = moments = moments.update(scores)
    else:
        raise ValueError(f"normalize must be none, group, batch or running, got {mode!r}")
    return [(s - stats.mean) / (stats.std + EPS) for s in scores], moments


# --- the reward function --------------------------------------------------------------


class NormalizedReward:
    """A scorer as a batched reward function `(prompts, completions, **fields) -> scores`, with the
    entry's normalisation, its running moments (snapshot state) and a one-batch memory, so `raw`
    and `__call__` on the same batch cost one scoring. Subclasses score in `_forward`: in process
    (`RewardModelReward`) or over HTTP (`rollout.rl.served_reward.ServedRewardModel`)."""

    def __init__(self, *, normalize: Normalize = "none") -> None:
        self.normalize = normalize
        self.moments = Moments()
        self._lock = threading.Lock()  # a timed-out call may still run in its thread
        self._last: tuple[tuple[tuple[str, ...], tuple[str, ...]], list[float]] | None = None

    def __call__(self, prompts: list[Prompt], completions: list[str], **_: list[Any]) -> list[float]:
        """The normalised scores (what enters the weighted sum)."""
        raw = self.score(prompts, completions)
        groups = [_prompt_key(p) for p in prompts] if self.normalize == "group" else None
        with self._lock:
            scores, self.moments = normalize_scores(raw, self.normalize, self.moments, groups)
        return scores

    def raw(self, prompts: list[Prompt], completions: list[str], **_: list[Any]) -> list[float]:
        """The raw scores, as a reward function (logged beside the normalised ones, weight 0)."""
        return self.score(prompts, completions)

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """The raw score of every (prompt, completion); the last batch is remembered."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        key = (tuple(_prompt_key(p) for p in prompts), tuple(completions))
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return list(self._last[1])
            scores = self._forward(prompts, completions)
            self._last = (key, scores)
            return list(scores)

    def _forward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """JSON: the running moments (what a resumed run needs)."""
        m = self.moments
        return {"count": m.count, "mean": m.mean, "m2": m.m2}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.moments = Moments(count=int(state["count"]), mean=float(state["mean"]), m2=float(state["m2"]))


class RewardModelReward(NormalizedReward):
    """A frozen reward model scoring in this process."""

    def __init__(
        self, model: Any, tokenizer: Any, *, device: Any, batch_size: int = 32, max_seq_len: int = 512,
        normalize: Normalize = "none",
    ) -> None:
        super().__init__(normalize=normalize)
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def _forward(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        return self.score_samples(self.tokenize(prompts, completions))

    def score_samples(self, samples: Sequence[Any]) -> list[float]:
        """Scores of tokenised samples (`tokenize`), in batches sorted by length (less padding)."""
        import torch

        from rollout.algorithms.rm import score_sequences
        from rollout.backends.torch_backend import move_to
        from rollout.data.collate import collate_padded

        order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
        out = [0.0] * len(samples)
        with torch.inference_mode():  # grad mode is per thread: set here, in the scoring thread
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                batch = collate_padded([samples[i] for i in idx], self.tokenizer.pad_token_id)
                scores = score_sequences(self.model, move_to(batch, self.device)).tolist()
                for i, s in zip(idx, scores, strict=True):
                    out[i] = float(s)
        return out

    def tokenize(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Any]:
        """Token ids of each prompt + completion, rendered as `rollout train rm` renders a pair's side."""
        from rollout.data.tokenize import tokenize_sft

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        rows = [Row(line=i + 1, data=_as_line(p, c)) for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        samples, stats = tokenize_sft(rows, self.tokenizer, loss_on="full", max_seq_len=self.max_seq_len)
        if stats.num_dropped:  # only a sequence of one token is dropped: an empty text prompt and completion
            raise ValueError(f"{stats.num_dropped} prompt + completion rendered to a single token")
        return samples


def _prompt_key(prompt: Prompt) -> str:
    return f"text:{prompt}" if isinstance(prompt, str) else "chat:" + json.dumps([dict(m) for m in prompt], sort_keys=True)


def _as_line(prompt: Prompt, completion: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt, "completion": completion}
    return {"messages": [dict(m) for m in prompt] + [{"role": "assistant", "content": completion}]}


# --- loading --------------------------------------------------------------------------


def load_reward_model(
    path: str | Path, *, device: Any, dtype: str = "float32", batch_size: int = 32, max_seq_len: int = 512,
    normalize: Normalize = "none", seed: int = 0,
) -> RewardModelReward:
    """The RM export folder at `path` as a frozen reward function (`ModelError` if it is not an RM)."""
    from rollout.models.load import ModelSource, load_model, load_tokenizer

    check_reward_model_dir(Path(path))
    source = ModelSource(uri=str(path), dtype=dtype)  # type: ignore[arg-type]
    tokenizer = load_tokenizer(source)
    model = load_model(source, task="reward", pad_token_id=tokenizer.pad_token_id, seed=seed)
    model.requires_grad_(False)
    model.eval()
    return RewardModelReward(
        model.to(device), tokenizer, device=device, batch_size=batch_size, max_seq_len=max_seq_len,
        normalize=normalize,
    )


def check_reward_model_dir(path: Path) -> None:
    """`path` holds a 1-logit sequence-classification model (what `rollout train rm` exports)."""
    from rollout.algorithms.config import reward_model_dir_problem

    problem = reward_model_dir_problem(path)
    if problem is not None:
        raise ModelError(f"reward model {path}: {problem}")


def export_reward_model_snapshot(store: Any, objects: Any, snapshot_id: str, out_root: Path) -> Path:
    """Export an RM train_state snapshot of `store` to `out_root/<id>` once; the folder."""
    from rollout.export import export_snapshot

    record = store.get_snapshot(snapshot_id)
    kind = record.manifest.get("extra", {}).get("model_class")
    if record.kind != "train_state" or kind != "reward":
        raise ConfigError(
            f"snapshot {record.id[:12]} is not a reward model (kind {record.kind}, model {kind or 'unknown'})"
        )
    out = out_root / record.id
    if not (out / "config.json").is_file():
        export_snapshot(store, objects, record, out)
    return out
