"""`rollout eval compare A B`: per-metric deltas, paired-bootstrap CIs over shared prompts, flipped prompts.

    comparison = compare_evals(record_a, samples_a, record_b, samples_b)
    comparison["metrics"]["pass@1"]   # {"a", "b", "delta", "paired_delta", "ci_low", "ci_high"}
    comparison["flipped"]["regressed"]  # prompt indices solved (by majority) in A but not in B

Prompts are paired by their index in the data file, so the comparison means something when
both evals ran on the same data (`same_data`: equal blake3 digests). The paired CI of a
per-prompt metric (pass@k, pass^k, maj@k, avg@k) resamples the per-prompt differences, so
prompt difficulty cancels out; the usage metrics (mean_reward, mean_turns, ...) get a delta only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.eval.metrics import (
    compare_summaries,
    flipped_prompts,
    paired_delta_ci,
    per_prompt_values,
    summarize,
)
from rollout.eval.runner import to_outcome
from rollout.store.base import EvalRecord, EvalSampleRecord

BOOTSTRAP_SEED = 0


def compare_evals(
    a: EvalRecord, a_samples: Sequence[EvalSampleRecord], b: EvalRecord, b_samples: Sequence[EvalSampleRecord]
) -> dict[str, Any]:
    """The JSON `eval compare --json` prints (deltas are b − a)."""
    a_outcomes = [to_outcome(s) for s in a_samples]
    b_outcomes = [to_outcome(s) for s in b_samples]
    a_metrics, b_metrics = _metrics(a, a_outcomes), _metrics(b, b_outcomes)
    metrics: dict[str, dict[str, float | None]] = {}
    for d in compare_summaries(a_metrics, b_metrics):
        entry: dict[str, float | None] = {
            "a": d.a, "b": d.b, "delta": d.delta, "paired_delta": None, "ci_low": None, "ci_high": None,
        }  # fmt: skip
        paired = _paired(d.name, a_outcomes, b_outcomes)
        if paired is not None:
            entry.update(paired_delta=paired.delta, ci_low=paired.ci_low, ci_high=paired.ci_high)
        metrics[d.name] = entry
    shared = {o.prompt_index for o in a_outcomes} & {o.prompt_index for o in b_outcomes}
    flipped = (
        flipped_prompts(a_outcomes, b_outcomes)
        if a_outcomes and b_outcomes
        else {"improved": [], "regressed": [], "newly_solved": [], "no_longer_solved": []}
    )
    return {
        "a": _side(a, len(a_samples)),
        "b": _side(b, len(b_samples)),
        "same_data": a.data_digest == b.data_digest,
        "n_shared_prompts": len(shared),
        "metrics": metrics,
        "flipped": flipped,
    }


def _metrics(record: EvalRecord, outcomes: list[Any]) -> dict[str, float]:
    """The stored summary's metrics; for an unfinished eval, a summary of what it stored so far."""
    if record.summary is not None:
        return dict(record.summary.get("metrics", {}))
    return dict(summarize(outcomes, seed=record.seed).metrics) if outcomes else {}


def _paired(name: str, a_outcomes: list[Any], b_outcomes: list[Any]) -> Any:
    try:
        return paired_delta_ci(
            per_prompt_values(a_outcomes, name), per_prompt_values(b_outcomes, name), seed=BOOTSTRAP_SEED
        )
    except ValueError:  # not a per-prompt metric, too few samples for k, or no shared prompt
        return None


def _side(record: EvalRecord, stored: int) -> dict[str, Any]:
    return {
        "eval_id": record.id,
        "name": record.name,
        "status": record.status,
        "model": record.model,
        "env": record.env,
        "n_prompts": record.n_prompts,
        "n": record.n,
        "n_samples": stored,
    }
