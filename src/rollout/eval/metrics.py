"""Eval metrics: unbiased pass@k / pass^k, exact maj@k, avg@k, bootstrap CIs, summaries, comparisons.

    outcomes = [SampleOutcome(prompt_index=p, sample_index=s, reward=r, success=r == 1.0, answer=a), ...]
    summary = summarize(outcomes, ks=[1, 4, 16], seed=0)
    summary.metrics            # {"pass@1": 0.62, "pass@1_ci_low": 0.55, "pass@1_ci_high": 0.69, "pass^1": ...}
    summary.not_computable     # {"pass@16": "prompt 3 has 8 samples, fewer than k=16", ...}

Every estimator works on the n samples drawn for ONE prompt and estimates a property of k
samples drawn from the same policy; a benchmark number is the mean over prompts of the
per-prompt estimates, with a percentile-bootstrap CI that resamples prompts. Nothing is ever
guessed: when a prompt has fewer than k samples the estimator returns None and `summarize`
reports the metric in `not_computable` instead of in `metrics`.

Pure stdlib (no numpy/torch), so `rollout eval --help` and `eval show` stay instant.

About 530 lines on purpose: pure functions (no I/O, stdlib only) whose estimators,
confidence intervals and comparisons must agree with each other; most of the
length is the docstrings stating each formula.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

# ---------------------------------------------------------------- per-prompt estimators


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass@k from n samples of which c succeeded: P(at least one of k samples succeeds).

    pass@k = 1 − C(n−c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", arXiv:2107.03374, eq. 1), computed in their numerically stable product
    form 1 − ∏_{i=n−c+1}^{n} (1 − k/i), which never forms the huge binomials. Exactly 1.0 when
    n − c < k (every k-subset holds a success); None when n < k (not computable from n samples).
    Raises ValueError unless 0 <= c <= n and k >= 1.
    """
    _check_counts(n, c, k)
    if n < k:
        return None
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def pass_hat_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass^k from n samples of which c succeeded: P(all of k samples succeed).

    pass^k = C(c, k) / C(n, k) (the reliability metric of tau-bench, Yao et al. 2024,
    arXiv:2406.12045), computed as the product ∏_{i=0}^{k−1} (c−i)/(n−i). 0.0 when c < k;
    None when n < k. pass^1 == pass@1 == c/n. Raises ValueError unless 0 <= c <= n and k >= 1.
    """
    _check_counts(n, c, k)
    if n < k:
        return None
    if c < k:
        return 0.0
    prob = 1.0
    for i in range(k):
        prob *= (c - i) / (n - i)
    return prob


def avg_at_k(rewards: Sequence[float]) -> float:
    """avg@k: the mean reward of the n samples.

    The expected mean reward of k samples drawn without replacement from the n equals the mean
    of all n (linearity of expectation), so the estimator is unbiased for every k <= n and does
    not depend on k; `summarize` still reports it per k so the avg@k columns line up with the
    others. Raises ValueError on an empty sequence.
    """
    if len(rewards) == 0:
        raise ValueError("avg_at_k needs at least one reward")
    return math.fsum(rewards) / len(rewards)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float | None:
    """Exact maj@k: the expected score of majority voting over k of the n samples.

    The expectation is over all C(n, k) subsets of size k (k samples drawn uniformly without
    replacement), so the estimate is unbiased and has no sampling noise of its own. Within a
    subset:
    - a sample whose answer is None (nothing extracted, or the sample failed) does not vote;
    - the answers with the most votes are the top answers; the subset scores the fraction of
      top answers that are correct (1/t when one correct answer ties with t−1 others, 0 when
      none of them is correct); a subset with no votes at all scores 0;
    - an answer string is correct iff ANY sample carrying it has correct=True (samples with the
      same answer should agree; this makes a stray disagreement count in the answer's favour).
      Several distinct strings may be correct (e.g. "0.5" and "1/2").

    Computed without enumerating subsets. By linearity, C(n, k)·E[score] = Σ over correct
    groups g and top counts v of C(s_g, v) · Σ_w 1/(1 + t(w)), where w ranges over the ways to
    pick the other k − v samples with every other group getting <= v votes and t(w) groups
    tying at exactly v. For a given v, groups smaller than v and the abstainers can never
    reach v: they merge into one free pool counted by a single binomial; the groups of size
    >= v go through a product of truncated binomials Σ_{u<=v} C(s, u) x^u tracked by (samples
    taken, groups at v) (`_tie_weighted_ways`). When v > k/2 no other group can reach v and
    the count is closed-form. Integer and Fraction arithmetic throughout, so the value is exact
    up to the final float conversion; n = 256, k = 128 takes well under a second. None when
    n < k; ValueError unless k >= 1 and the two sequences have the same length.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"maj_at_k: {n} answers but {len(correct)} correctness flags")
    if k < 1:
        raise ValueError(f"maj_at_k: k must be >= 1, got {k}")
    if n < k:
        return None
    sizes: dict[str, int] = {}
    is_correct: dict[str, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is None:
            continue
        sizes[answer] = sizes.get(answer, 0) + 1
        is_correct[answer] = is_correct.get(answer, False) or bool(ok)
    groups = [(sizes[a], is_correct[a]) for a in sizes]
    n_abstain = n - sum(sizes.values())
    if not any(ok for _, ok in groups):
        return 0.0
    if k == n:  # a single subset: vote directly
        top = max(s for s, _ in groups)
        tied = [ok for s, ok in groups if s == top]
        return sum(tied) / len(tied)

    total = Fraction(0)
    for v in range(1, min(k, max(s for s, _ in groups)) + 1):
        big = [(s, ok) for s, ok in groups if s >= v]
        if not any(ok for _, ok in big):
            break  # groups only drop out as v grows, so no correct group can be on top again
        if 2 * v > k:
            # A group holding v > k/2 of the k votes is the unique top whatever the other k - v
            # votes do: no constraint on the rest and no tie.
            total += sum(math.comb(s, v) * math.comb(n - s, k - v) for s, ok in big if ok)
            continue
        pool = n_abstain + sum(s for s, _ in groups if s < v)
        by_top_size: dict[int, Fraction] = {}  # correct groups of equal size share one DP
        for i, (s_top, ok) in enumerate(big):
            if not ok:
                continue
            if s_top not in by_top_size:
                others = [s for j, (s, _) in enumerate(big) if j != i]
                by_top_size[s_top] = _tie_weighted_ways(others, pool, budget=k - v, v=v)
            total += math.comb(s_top, v) * by_top_size[s_top]
    return float(total / math.comb(n, k))


def _tie_weighted_ways(others: Sequence[int], pool: int, *, budget: int, v: int) -> Fraction:
    """Σ over ways to pick `budget` samples, each group in `others` given <= v, of 1/(1 + #groups at v).

    `others` are the sizes of the voting groups that could tie at v; `pool` counts the samples
    that can never reach v (abstainers and smaller groups), so they are free. DP state:
    (samples taken from `others`, how many of them sit at exactly v) -> number of ways.
    """
    states: dict[tuple[int, int], int] = {(0, 0): 1}
    for s in others:
        ways = [math.comb(s, u) for u in range(v + 1)]
        nxt: dict[tuple[int, int], int] = {}
        for (used, t), count in states.items():
            for u in range(min(v, budget - used) + 1):
                key = (used + u, t + (u == v))
                nxt[key] = nxt.get(key, 0) + ways[u] * count
        states = nxt
    by_ties: dict[int, int] = {}
    for (used, t), count in states.items():
        if budget - used <= pool:
            by_ties[t] = by_ties.get(t, 0) + count * math.comb(pool, budget - used)
    return sum((Fraction(count, 1 + t) for t, count in by_ties.items()), Fraction(0))


def _check_counts(n: int, c: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")


# ---------------------------------------------------------------- bootstrap


def bootstrap_ci(
    per_prompt_values: Sequence[float],
    *,
    seed: int,
    n_resamples: int = 1000,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile-bootstrap CI of the mean over prompts (Efron & Tibshirani 1993, ch. 13).

    Each resample draws len(values) prompts with replacement from `random.Random(seed)`; the CI
    is the (1−confidence)/2 and (1+confidence)/2 quantiles of the resampled means, with linear
    interpolation between order statistics (numpy's default). Deterministic for a given seed.
    Constant input (one prompt, or all values equal) returns (value, value). The CI reflects
    prompt-sampling noise only, the right notion for "how would this score move on another
    draw of prompts from the same distribution".
    """
    return _bootstrap_cis([per_prompt_values], seed=seed, n_resamples=n_resamples, confidence=confidence)[0]


def _bootstrap_cis(
    columns: Sequence[Sequence[float]], *, seed: int, n_resamples: int, confidence: float
) -> list[tuple[float, float]]:
    """`bootstrap_ci` for several columns over the same prompts, sharing one resample stream.

    Column j's CI is exactly `bootstrap_ci(columns[j], seed=seed)`: the resampled index lists
    depend only on the seed and the number of prompts, so drawing them once serves every column.
    """
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(columns[0]) if columns else 0
    if n == 0 or any(len(col) != n for col in columns):
        raise ValueError("bootstrap needs one or more prompts, the same number in every column")
    constant = [min(col) == max(col) for col in columns]
    means: list[list[float]] = [[] for _ in columns]
    if not all(constant):
        rng = random.Random(seed)
        population = range(n)
        for _ in range(n_resamples):
            idx = rng.choices(population, k=n)
            for j, col in enumerate(columns):
                if not constant[j]:
                    means[j].append(math.fsum(map(col.__getitem__, idx)) / n)
    alpha = (1.0 - confidence) / 2.0
    cis: list[tuple[float, float]] = []
    for j, col in enumerate(columns):
        if constant[j]:
            cis.append((float(col[0]), float(col[0])))
            continue
        ordered = sorted(means[j])
        cis.append((_quantile(ordered, alpha), _quantile(ordered, 1.0 - alpha)))
    return cis


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---------------------------------------------------------------- per-sample rows and summaries


@dataclass(frozen=True)
class SampleOutcome:
    """One scored eval sample: what `summarize` needs of a stored eval row.

    `failed` means the sample could not be produced at all (e.g. the endpoint still errored
    after its retries). Whatever else such a row carries, the metrics treat it as a sample that
    was drawn and lost: not successful, reward 0, no answer (no vote) — so failures lower the
    scores instead of silently shrinking n — and it is counted in `n_failed`. A non-failed
    sample with `reward=None` (no reward recorded) counts as reward float(success).
    """

    prompt_index: int
    sample_index: int
    reward: float | None
    success: bool
    answer: str | None
    turns: int = 1
    tool_calls: int = 0
    completion_tokens: int = 0
    truncated: bool = False
    failed: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_index", "sample_index", "turns", "tool_calls", "completion_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"SampleOutcome.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def scored_success(self) -> bool:
        """Success as the metrics count it (False for a failed sample)."""
        return self.success and not self.failed

    @property
    def scored_reward(self) -> float:
        """Reward as the metrics count it (0 for a failed sample, success for a missing reward)."""
        if self.failed:
            return 0.0
        return float(self.success) if self.reward is None else float(self.reward)

    @property
    def scored_answer(self) -> str | None:
        """Answer as majority voting sees it (None, i.e. no vote, for a failed sample)."""
        return None if self.failed else self.answer


@dataclass(frozen=True)
class EvalSummary:
    """The aggregate of one eval; `metrics` is flat, JSON-able and in a stable key order.

    Key order: for each k ascending, pass@k, pass^k, maj@k (only when some sample has an
    answer), avg@k, each followed by its `_ci_low` / `_ci_high`; then mean_reward, mean_turns,
    mean_tool_calls, mean_completion_tokens, truncation_rate, n_failed. `not_computable` maps
    each metric left out to the reason.
    """

    n_prompts: int
    n_samples: int
    ks: tuple[int, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    not_computable: dict[str, str] = field(default_factory=dict)


_FAMILIES = ("pass@", "pass^", "maj@", "avg@")
_METRIC_NAME = re.compile(r"^(pass@|pass\^|maj@|avg@)([1-9][0-9]*)$")


def summarize(
    outcomes: Iterable[SampleOutcome],
    *,
    ks: Sequence[int] | None = None,
    seed: int = 0,
    n_resamples: int = 1000,
) -> EvalSummary:
    """Aggregate per-sample outcomes into pass@k, pass^k, maj@k, avg@k (with 95% CIs) and usage.

    Each pass/maj/avg metric is the mean over prompts of the per-prompt estimator (prompts
    weigh equally whatever their sample count); its CI is `bootstrap_ci` of the per-prompt
    values with this `seed`. `ks` defaults to 1, 2, 4, ... up to the smallest per-prompt
    sample count; a k above some prompt's count puts that k's metrics in `not_computable`.
    mean_reward and the usage means are over samples (micro averages): mean_reward counts
    failed samples as 0; mean_turns, mean_tool_calls, mean_completion_tokens and
    truncation_rate are over the samples that were produced (not failed).
    Deterministic: the same outcomes in any order with the same seed give the same summary.
    """
    groups = _group_by_prompt(outcomes)
    sample_counts = {p: len(samples) for p, samples in groups.items()}
    min_prompt = min(sample_counts, key=lambda p: (sample_counts[p], p))
    min_n = sample_counts[min_prompt]
    if ks is None:
        ks = [1 << e for e in range(min_n.bit_length())]  # 1, 2, 4, ... <= min_n
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got {list(ks)}")
    ks_sorted = tuple(sorted(set(ks)))
    families = [f for f in _FAMILIES if f != "maj@" or _has_answers(groups)]

    names: list[str] = []
    columns: list[list[float]] = []
    not_computable: dict[str, str] = {}
    for k in ks_sorted:
        for family in families:
            name = f"{family}{k}"
            if k > min_n:
                not_computable[name] = f"prompt {min_prompt} has {min_n} samples, fewer than k={k}"
                continue
            names.append(name)
            columns.append([_prompt_value(samples, family, k) for samples in groups.values()])

    metrics: dict[str, float] = {}
    cis = _bootstrap_cis(columns, seed=seed, n_resamples=n_resamples, confidence=0.95) if columns else []
    for name, col, (low, high) in zip(names, columns, cis, strict=True):
        metrics[name] = math.fsum(col) / len(col)
        metrics[f"{name}_ci_low"] = low
        metrics[f"{name}_ci_high"] = high

    every = [o for samples in groups.values() for o in samples]
    produced = [o for o in every if not o.failed]
    metrics["mean_reward"] = math.fsum(o.scored_reward for o in every) / len(every)
    usage = {
        "mean_turns": lambda o: o.turns,
        "mean_tool_calls": lambda o: o.tool_calls,
        "mean_completion_tokens": lambda o: o.completion_tokens,
        "truncation_rate": lambda o: float(o.truncated),
    }
    for name, get in usage.items():
        if produced:
            metrics[name] = math.fsum(get(o) for o in produced) / len(produced)
        else:
            not_computable[name] = "every sample failed"
    metrics["n_failed"] = len(every) - len(produced)
    return EvalSummary(
        n_prompts=len(groups),
        n_samples=len(every),
        ks=ks_sorted,
        metrics=metrics,
        not_computable=not_computable,
    )


def per_prompt_values(outcomes: Iterable[SampleOutcome], metric: str) -> dict[int, float]:
    """The per-prompt estimates behind one metric ("pass@4", "pass^2", "maj@8", "avg@1"), by prompt.

    Feeds `paired_delta_ci`. Raises ValueError for an unknown metric name or when some prompt
    has fewer samples than k.
    """
    match = _METRIC_NAME.match(metric)
    if match is None:
        raise ValueError(f"unknown metric {metric!r}; expected pass@K, pass^K, maj@K or avg@K")
    family, k = match.group(1), int(match.group(2))
    values: dict[int, float] = {}
    for prompt, samples in _group_by_prompt(outcomes).items():
        if len(samples) < k:
            raise ValueError(f"{metric} is not computable: prompt {prompt} has {len(samples)} samples")
        values[prompt] = _prompt_value(samples, family, k)
    return values


def _group_by_prompt(outcomes: Iterable[SampleOutcome]) -> dict[int, list[SampleOutcome]]:
    """Outcomes grouped by prompt, prompts and samples in index order; duplicates are an error."""
    ordered = sorted(outcomes, key=lambda o: (o.prompt_index, o.sample_index))
    if not ordered:
        raise ValueError("no eval outcomes to summarise")
    groups: dict[int, list[SampleOutcome]] = {}
    previous: tuple[int, int] | None = None
    for o in ordered:
        key = (o.prompt_index, o.sample_index)
        if key == previous:
            raise ValueError(f"duplicate outcome for prompt {key[0]}, sample {key[1]}")
        previous = key
        groups.setdefault(o.prompt_index, []).append(o)
    return groups


def _has_answers(groups: Mapping[int, Sequence[SampleOutcome]]) -> bool:
    return any(o.scored_answer is not None for samples in groups.values() for o in samples)


def _prompt_value(samples: Sequence[SampleOutcome], family: str, k: int) -> float:
    """One prompt's estimate for `family` at k; the caller has checked len(samples) >= k."""
    n = len(samples)
    c = sum(o.scored_success for o in samples)
    if family == "pass@":
        value = pass_at_k(n, c, k)
    elif family == "pass^":
        value = pass_hat_k(n, c, k)
    elif family == "maj@":
        value = maj_at_k([o.scored_answer for o in samples], [o.scored_success for o in samples], k)
    else:
        value = avg_at_k([o.scored_reward for o in samples])
    assert value is not None, "caller checks n >= k"
    return value


# ---------------------------------------------------------------- comparing two evals


@dataclass(frozen=True)
class MetricDelta:
    """One metric in two evals: `delta = b − a`, None where either side lacks the metric."""

    name: str
    a: float | None
    b: float | None
    delta: float | None


def compare_summaries(a: Mapping[str, float], b: Mapping[str, float]) -> list[MetricDelta]:
    """Metric-by-metric deltas (b − a) of two `EvalSummary.metrics` dicts.

    Metrics in a's order, then those only in b. The `_ci_low` / `_ci_high` entries are left
    out: the difference of two CIs is not a CI of the difference (use `paired_delta_ci`).
    """
    names = [m for m in a if not _is_ci_key(m)]
    names += [m for m in b if m not in a and not _is_ci_key(m)]
    deltas: list[MetricDelta] = []
    for name in names:
        va, vb = a.get(name), b.get(name)
        delta = None if va is None or vb is None else vb - va
        deltas.append(MetricDelta(name=name, a=va, b=vb, delta=delta))
    return deltas


def _is_ci_key(name: str) -> bool:
    return name.endswith("_ci_low") or name.endswith("_ci_high")


def flipped_prompts(
    a_outcomes: Iterable[SampleOutcome], b_outcomes: Iterable[SampleOutcome]
) -> dict[str, list[int]]:
    """Prompts whose outcome changed between eval a and eval b, by prompt index.

    With r the prompt's success rate (successes / samples, the pass@1 estimate):
    - "improved" / "regressed": the prompt is solved by majority (r > 0.5) in b but not in a,
      or the reverse. With one sample per prompt this is simply fail→pass / pass→fail.
    - "newly_solved" / "no_longer_solved": r goes from 0 to > 0 or from > 0 to 0 (a change of
      coverage, i.e. of pass@n).
    - "only_in_a" / "only_in_b": prompts evaluated in one run only (never counted as flips).
    """
    rates_a = per_prompt_values(a_outcomes, "pass@1")
    rates_b = per_prompt_values(b_outcomes, "pass@1")
    shared = sorted(rates_a.keys() & rates_b.keys())
    return {
        "improved": [p for p in shared if rates_a[p] <= 0.5 < rates_b[p]],
        "regressed": [p for p in shared if rates_b[p] <= 0.5 < rates_a[p]],
        "newly_solved": [p for p in shared if rates_a[p] == 0.0 < rates_b[p]],
        "no_longer_solved": [p for p in shared if rates_b[p] == 0.0 < rates_a[p]],
        "only_in_a": sorted(rates_a.keys() - rates_b.keys()),
        "only_in_b": sorted(rates_b.keys() - rates_a.keys()),
    }


@dataclass(frozen=True)
class PairedDelta:
    """Mean of b − a over the shared prompts, with its paired-bootstrap CI."""

    n_shared: int
    delta: float
    ci_low: float
    ci_high: float


def paired_delta_ci(
    a_per_prompt: Mapping[int, float],
    b_per_prompt: Mapping[int, float],
    *,
    seed: int,
    n_resamples: int = 1000,
    confidence: float = 0.95,
) -> PairedDelta:
    """Paired bootstrap of the mean per-prompt difference b − a over the prompts both evals share.

    Resampling prompt-level differences keeps the pairing, so prompt difficulty (shared by both
    evals) cancels and the CI is much tighter than comparing two unpaired CIs. Inputs are
    per-prompt values keyed by prompt index, e.g. from `per_prompt_values(outcomes, "pass@1")`.
    Raises ValueError when no prompt is shared.
    """
    shared = sorted(a_per_prompt.keys() & b_per_prompt.keys())
    if not shared:
        raise ValueError("the two evals share no prompt")
    diffs = [b_per_prompt[p] - a_per_prompt[p] for p in shared]
    low, high = bootstrap_ci(diffs, seed=seed, n_resamples=n_resamples, confidence=confidence)
    return PairedDelta(n_shared=len(shared), delta=math.fsum(diffs) / len(diffs), ci_low=low, ci_high=high)
