"""Eval metrics against hand-computed values, exact rational arithmetic and brute-force enumeration."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from rollout.eval.metrics import (
    EvalSummary,
    MetricDelta,
    PairedDelta,
    SampleOutcome,
    avg_at_k,
    bootstrap_ci,
    compare_summaries,
    flipped_prompts,
    maj_at_k,
    paired_delta_ci,
    pass_at_k,
    pass_hat_k,
    per_prompt_values,
    summarize,
)

# ---------------------------------------------------------------- pass@k / pass^k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (5, 0, 2, 0.0),  # no success at all
        (5, 5, 3, 1.0),  # every sample succeeds
        (5, 4, 2, 1.0),  # n - c = 1 < k: every pair holds a success
        (6, 3, 3, 0.95),  # 1 - C(3,3)/C(6,3) = 1 - 1/20
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_exactly_one_when_failures_fewer_than_k() -> None:
    assert pass_at_k(5, 4, 2) == 1.0
    assert pass_at_k(100, 99, 2) == 1.0


def test_pass_at_k_not_computable_when_n_below_k() -> None:
    assert pass_at_k(3, 1, 4) is None
    assert pass_at_k(3, 3, 4) is None  # even all-correct is not guessed


@pytest.mark.parametrize(("n", "c", "k"), [(5, -1, 1), (5, 6, 1), (5, 2, 0), (0, 0, 0)])
def test_pass_at_k_rejects_bad_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        pass_hat_k(n, c, k)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 3, 2, 0.3),  # C(3,2)/C(5,2) = 3/10
        (10, 5, 3, 1 / 12),  # C(5,3)/C(10,3) = 10/120
        (10, 7, 1, 0.7),  # pass^1 = c/n
        (5, 1, 2, 0.0),  # c < k
        (5, 5, 5, 1.0),  # all succeed
    ],
)
def test_pass_hat_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_hat_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_hat_k_not_computable_when_n_below_k() -> None:
    assert pass_hat_k(2, 2, 3) is None


@pytest.mark.parametrize(
    ("n", "c", "k"), [(1000, 500, 100), (1000, 5, 100), (1000, 990, 3), (500, 37, 250), (200, 1, 199)]
)
def test_pass_at_k_and_pass_hat_k_match_exact_binomials_at_large_n(n: int, c: int, k: int) -> None:
    exact_pass = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    exact_hat = Fraction(math.comb(c, k), math.comb(n, k))
    assert abs(pass_at_k(n, c, k) - float(exact_pass)) < 1e-12
    assert abs(pass_hat_k(n, c, k) - float(exact_hat)) < 1e-12


def test_pass_at_k_and_pass_hat_k_match_binomials_on_every_small_case() -> None:
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact_pass = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                exact_hat = Fraction(math.comb(c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass), abs=1e-13)
                assert pass_hat_k(n, c, k) == pytest.approx(float(exact_hat), abs=1e-13)


def test_avg_at_k_is_the_mean_reward() -> None:
    assert avg_at_k([1.0, 0.0, 0.5, 0.5]) == 0.5
    assert avg_at_k([0.25]) == 0.25
    with pytest.raises(ValueError):
        avg_at_k([])


# ---------------------------------------------------------------- maj@k


def test_maj_at_k_hand_values() -> None:
    # "a" (correct) x2, "b" (wrong) x1.
    # k=1: 2 of 3 samples say "a" -> 2/3.
    assert maj_at_k(["a", "a", "b"], [True, True, False], 1) == pytest.approx(2 / 3)
    # k=2: {a,a} -> 1, {a,b} twice -> tie -> 1/2 each: (1 + 1/2 + 1/2) / 3 = 2/3.
    assert maj_at_k(["a", "a", "b"], [True, True, False], 2) == pytest.approx(2 / 3)
    # k=3: "a" has 2 votes of 3 -> 1.
    assert maj_at_k(["a", "a", "b"], [True, True, False], 3) == 1.0
    # None does not vote: {a,None} -> 1, {a,b} -> 1/2, {None,b} -> 0: 1.5 / 3 = 0.5.
    assert maj_at_k(["a", None, "b"], [True, False, False], 2) == pytest.approx(0.5)
    # an answer is correct if ANY sample carrying it succeeded
    assert maj_at_k(["a", "a"], [True, False], 1) == 1.0
    # two correct strings tying: both on top and both correct -> 1
    assert maj_at_k(["0.5", "1/2"], [True, True], 2) == 1.0
    # three-way tie, two of the three top answers correct -> 2/3
    assert maj_at_k(["0.5", "1/2", "x"], [True, True, False], 3) == pytest.approx(2 / 3)


def test_maj_at_k_degenerate_inputs() -> None:
    assert maj_at_k([None, None, None], [False, True, False], 2) == 0.0  # no votes ever
    assert maj_at_k(["a", "b", "c"], [False, False, False], 2) == 0.0  # nothing correct
    assert maj_at_k(["a"] * 5, [True] * 5, 3) == 1.0  # all correct
    assert maj_at_k(["a", "b"], [True, False], 3) is None  # n < k
    with pytest.raises(ValueError):
        maj_at_k(["a", "b"], [True, False], 0)
    with pytest.raises(ValueError):
        maj_at_k(["a", "b"], [True], 1)


def _maj_brute_force(answers: list[str | None], correct: list[bool], k: int) -> Fraction:
    """Literal definition: average the majority-vote score over every size-k subset."""
    answer_correct: dict[str, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            answer_correct[answer] = answer_correct.get(answer, False) or ok
    total, n_subsets = Fraction(0), 0
    for subset in itertools.combinations(range(len(answers)), k):
        n_subsets += 1
        votes: dict[str, int] = {}
        for i in subset:
            if answers[i] is not None:
                votes[answers[i]] = votes.get(answers[i], 0) + 1
        if not votes:
            continue
        top_count = max(votes.values())
        top = [a for a, count in votes.items() if count == top_count]
        total += Fraction(sum(answer_correct[a] for a in top), len(top))
    return total / n_subsets


def test_maj_at_k_matches_brute_force_on_random_small_cases() -> None:
    rng = random.Random(1234)
    vocabularies: list[list[str | None]] = [
        ["a"],
        ["a", "b"],
        ["a", "b", None],
        ["a", "b", "c", "d", None],
        ["a", "b", "c", "d", "e", "f", "g"],
        [None],
    ]
    n_checked = 0
    for _ in range(1500):
        n = rng.randint(1, 10)
        k = rng.randint(1, n)
        vocab = rng.choice(vocabularies)
        answers = [rng.choice(vocab) for _ in range(n)]
        mode = rng.random()
        if mode < 0.15:
            correct = [False] * n  # c = 0
        elif mode < 0.3:
            correct = [True] * n  # all correct
        elif mode < 0.6:  # correctness per answer string, possibly several correct strings
            good = {a for a in vocab if a is not None and rng.random() < 0.4}
            correct = [a in good for a in answers]
        else:  # arbitrary per-sample flags (disagreeing samples of one answer included)
            correct = [rng.random() < 0.4 for _ in range(n)]
        expected = _maj_brute_force(answers, correct, k)
        assert maj_at_k(answers, correct, k) == pytest.approx(float(expected), abs=1e-12), (
            answers,
            correct,
            k,
        )
        n_checked += 1
    assert n_checked == 1500


def test_maj_at_k_matches_brute_force_on_forced_ties() -> None:
    # equal-size groups make ties at every top count
    for answers in (["a", "a", "b", "b", "c", "c"], ["a", "b", "c", "d", None, None, "a", "b"]):
        for good in ({"a"}, {"a", "b"}, {"c"}):
            correct = [a in good for a in answers]
            for k in range(1, len(answers) + 1):
                expected = _maj_brute_force(list(answers), correct, k)
                assert maj_at_k(answers, correct, k) == pytest.approx(float(expected), abs=1e-12)


def test_maj_at_k_large_n_against_closed_forms() -> None:
    # One voting answer (correct) plus abstainers: the vote is right iff some voter is drawn,
    # maj@k = 1 - C(#None, k) / C(n, k).
    answers: list[str | None] = ["a"] * 150 + [None] * 50
    correct = [a == "a" for a in answers]
    expected = 1 - Fraction(math.comb(50, 10), math.comb(200, 10))
    assert maj_at_k(answers, correct, 10) == pytest.approx(float(expected), abs=1e-12)

    # Two answers, "a" right (s_a = 90) and "b" wrong (s_b = 110): hypergeometric vote for "a",
    # a tie at k/2 counting 1/2.
    answers = ["a"] * 90 + ["b"] * 110
    correct = [a == "a" for a in answers]
    for k in (1, 7, 40, 64):
        wins = sum(
            Fraction(math.comb(90, u) * math.comb(110, k - u)) * (1 if 2 * u > k else Fraction(1, 2))
            for u in range(k + 1)
            if 2 * u >= k
        )
        expected = wins / math.comb(200, k)
        assert maj_at_k(answers, correct, k) == pytest.approx(float(expected), abs=1e-12)


def test_maj_at_k_at_one_is_the_fraction_of_correct_voters() -> None:
    answers: list[str | None] = ["x", "y", "y", None, "z", "y"]
    correct = [False, True, True, False, False, True]
    assert maj_at_k(answers, correct, 1) == pytest.approx(3 / 6)


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_ci_is_deterministic_per_seed() -> None:
    values = [(i * 37 % 101) / 100 for i in range(30)]  # 30 distinct values in [0, 1]
    first = bootstrap_ci(values, seed=7)
    assert bootstrap_ci(values, seed=7) == first
    assert bootstrap_ci(values, seed=8) != first
    low, high = first
    assert low <= sum(values) / len(values) <= high


def test_bootstrap_ci_degenerate_inputs() -> None:
    assert bootstrap_ci([0.7], seed=0) == (0.7, 0.7)
    assert bootstrap_ci([0.1, 0.1, 0.1], seed=0) == (0.1, 0.1)
    with pytest.raises(ValueError):
        bootstrap_ci([], seed=0)
    with pytest.raises(ValueError):
        bootstrap_ci([0.0, 1.0], seed=0, confidence=1.0)
    with pytest.raises(ValueError):
        bootstrap_ci([0.0, 1.0], seed=0, n_resamples=0)


def test_bootstrap_ci_two_values_spans_both() -> None:
    # resampled means of [0, 1] are 0, 0.5, 1 with probability 1/4, 1/2, 1/4: the 2.5% and
    # 97.5% quantiles are 0 and 1.
    assert bootstrap_ci([0.0, 1.0], seed=3, n_resamples=2000) == (0.0, 1.0)


def test_bootstrap_ci_covers_the_true_mean_about_95_percent_of_the_time() -> None:
    rng = random.Random(99)
    true_p, n_prompts, n_datasets = 0.3, 60, 200
    covered = 0
    for i in range(n_datasets):
        values = [float(rng.random() < true_p) for _ in range(n_prompts)]
        low, high = bootstrap_ci(values, seed=i, n_resamples=300)
        covered += low <= true_p <= high
    assert 0.88 <= covered / n_datasets <= 0.99


def test_bootstrap_ci_narrows_with_more_prompts() -> None:
    small = [float(i % 2) for i in range(20)]
    large = [float(i % 2) for i in range(2000)]
    lo_s, hi_s = bootstrap_ci(small, seed=0)
    lo_l, hi_l = bootstrap_ci(large, seed=0)
    assert hi_l - lo_l < (hi_s - lo_s) / 5


# ---------------------------------------------------------------- summarize


def _hand_built_outcomes() -> list[SampleOutcome]:
    """Three prompts, four samples each (see the expected values in the tests below)."""
    outcomes = []
    # prompt 0: successes T T F F, answers 4 4 5 None ("4" is right); sample 3 truncated.
    for s, (ok, answer) in enumerate([(True, "4"), (True, "4"), (False, "5"), (False, None)]):
        outcomes.append(
            SampleOutcome(
                prompt_index=0,
                sample_index=s,
                reward=float(ok),
                success=ok,
                answer=answer,
                completion_tokens=100 if s == 3 else 10,
                truncated=s == 3,
            )
        )
    # prompt 1: nothing right; rewards 0 0 0.5 and a FAILED sample whose fields are ignored.
    for s, (reward, answer) in enumerate([(0.0, "7"), (0.0, "8"), (0.5, "8")]):
        outcomes.append(
            SampleOutcome(
                prompt_index=1,
                sample_index=s,
                reward=reward,
                success=False,
                answer=answer,
                completion_tokens=10,
            )
        )
    outcomes.append(
        SampleOutcome(
            prompt_index=1, sample_index=3, reward=None, success=True, answer="9", turns=5, failed=True
        )
    )
    # prompt 2: all four right, two turns and one tool call each; reward left None -> float(success).
    for s in range(4):
        outcomes.append(
            SampleOutcome(
                prompt_index=2,
                sample_index=s,
                reward=None,
                success=True,
                answer="3",
                turns=2,
                tool_calls=1,
                completion_tokens=10,
            )
        )
    return outcomes


def test_summarize_hand_built_values() -> None:
    summary = summarize(_hand_built_outcomes(), seed=0)
    m = summary.metrics
    assert (summary.n_prompts, summary.n_samples, summary.ks) == (3, 12, (1, 2, 4))
    assert summary.not_computable == {}
    # per prompt (n = 4): P0 c=2, P1 c=0 (the failed sample is a failure), P2 c=4
    # pass@1 = (2/4 + 0 + 1) / 3
    assert m["pass@1"] == pytest.approx(0.5)
    # pass@2 = ((1 - C(2,2)/C(4,2)) + 0 + 1) / 3 = (5/6 + 1) / 3 = 11/18
    assert m["pass@2"] == pytest.approx(11 / 18)
    # pass@4: P0 has n - c = 2 < 4 -> 1; (1 + 0 + 1) / 3
    assert m["pass@4"] == pytest.approx(2 / 3)
    # pass^2 = (C(2,2)/C(4,2) + 0 + 1) / 3 = (1/6 + 1) / 3 = 7/18; pass^4 = (0 + 0 + 1) / 3
    assert m["pass^1"] == pytest.approx(0.5)
    assert m["pass^2"] == pytest.approx(7 / 18)
    assert m["pass^4"] == pytest.approx(1 / 3)
    # maj, P0 answers 4 4 5 None: k=1 -> 2/4; k=2 over 6 pairs: {4,4} 1, {4,5} x2 1/2 each,
    # {4,None} x2 1, {5,None} 0 -> 4/6; k=4 -> "4" wins 2-1 -> 1. P1 0 (nothing right), P2 1.
    assert m["maj@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["maj@2"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert m["maj@4"] == pytest.approx((1 + 0 + 1) / 3)
    # avg: P0 2/4, P1 (0 + 0 + 0.5 + 0 failed) / 4 = 1/8, P2 1 -> (1/2 + 1/8 + 1) / 3 = 13/24 for every k
    for k in (1, 2, 4):
        assert m[f"avg@{k}"] == pytest.approx(13 / 24)
    # sample-level: rewards sum 2 + 0.5 + 4 = 6.5 over 12 samples (the failed one counts 0)
    assert m["mean_reward"] == pytest.approx(6.5 / 12)
    # usage over the 11 produced samples: turns 4*1 + 3*1 + 4*2 = 15, tool calls 4,
    # tokens 3*10 + 100 + 3*10 + 4*10 = 200, one truncated
    assert m["mean_turns"] == pytest.approx(15 / 11)
    assert m["mean_tool_calls"] == pytest.approx(4 / 11)
    assert m["mean_completion_tokens"] == pytest.approx(200 / 11)
    assert m["truncation_rate"] == pytest.approx(1 / 11)
    assert m["n_failed"] == 1


def test_summarize_key_order_and_cis() -> None:
    summary = summarize(_hand_built_outcomes(), seed=5, n_resamples=500)
    expected_keys = []
    for k in (1, 2, 4):
        for family in ("pass@", "pass^", "maj@", "avg@"):
            expected_keys += [f"{family}{k}", f"{family}{k}_ci_low", f"{family}{k}_ci_high"]
    expected_keys += [
        "mean_reward",
        "mean_turns",
        "mean_tool_calls",
        "mean_completion_tokens",
        "truncation_rate",
        "n_failed",
    ]
    assert list(summary.metrics) == expected_keys
    # each CI is exactly bootstrap_ci of the per-prompt values with the summary's seed
    per_prompt_pass2 = [5 / 6, 0.0, 1.0]
    low, high = bootstrap_ci(per_prompt_pass2, seed=5, n_resamples=500)
    assert summary.metrics["pass@2_ci_low"] == pytest.approx(low, abs=1e-15)
    assert summary.metrics["pass@2_ci_high"] == pytest.approx(high, abs=1e-15)
    for name in ("pass@1", "pass^2", "maj@2", "avg@4"):
        m = summary.metrics
        assert m[f"{name}_ci_low"] <= m[name] <= m[f"{name}_ci_high"]


def test_summarize_is_invariant_to_outcome_order() -> None:
    outcomes = _hand_built_outcomes()
    reference = summarize(outcomes, seed=11)
    for trial in range(5):
        shuffled = list(outcomes)
        random.Random(trial).shuffle(shuffled)
        again = summarize(shuffled, seed=11)
        assert again == reference
        assert list(again.metrics.items()) == list(reference.metrics.items())
    # with more prompts, another seed moves the CIs (and only the CIs)
    many = [
        SampleOutcome(prompt_index=p, sample_index=s, reward=float(s < p % 5), success=s < p % 5, answer=None)
        for p in range(40)
        for s in range(4)
    ]
    first, second = summarize(many, seed=1).metrics, summarize(many, seed=2).metrics
    assert (
        first["pass@1_ci_low"] != second["pass@1_ci_low"]
        or first["pass@1_ci_high"] != second["pass@1_ci_high"]
    )
    assert {k: v for k, v in first.items() if "_ci_" not in k} == {
        k: v for k, v in second.items() if "_ci_" not in k
    }


def test_summarize_reports_not_computable_ks() -> None:
    outcomes = [
        SampleOutcome(prompt_index=p, sample_index=s, reward=1.0, success=True, answer="a")
        for p, n in ((0, 4), (1, 2), (2, 3))
        for s in range(n)
    ]
    summary = summarize(outcomes, ks=[4, 1, 2, 2])
    assert summary.ks == (1, 2, 4)
    assert "pass@2" in summary.metrics and "pass@4" not in summary.metrics
    assert set(summary.not_computable) == {"pass@4", "pass^4", "maj@4", "avg@4"}
    assert summary.not_computable["pass@4"] == "prompt 1 has 2 samples, fewer than k=4"
    # default ks stop at the smallest per-prompt count (2 -> 1, 2)
    assert summarize(outcomes).ks == (1, 2)


def test_summarize_without_answers_omits_maj() -> None:
    outcomes = [
        SampleOutcome(prompt_index=p, sample_index=s, reward=float(s == 0), success=s == 0, answer=None)
        for p in range(3)
        for s in range(2)
    ]
    summary = summarize(outcomes)
    assert not any(name.startswith("maj@") for name in summary.metrics)
    assert summary.not_computable == {}
    assert summary.metrics["pass@1"] == pytest.approx(0.5)
    assert summary.metrics["pass@2"] == 1.0


def test_summarize_when_every_sample_failed() -> None:
    outcomes = [
        SampleOutcome(prompt_index=0, sample_index=s, reward=1.0, success=True, answer="a", failed=True)
        for s in range(2)
    ]
    summary = summarize(outcomes)
    assert summary.metrics["pass@1"] == 0.0
    assert "maj@1" not in summary.metrics  # failed samples carry no vote, so nobody answered
    assert summary.metrics["mean_reward"] == 0.0
    assert summary.metrics["n_failed"] == 2
    assert summary.not_computable["mean_turns"] == "every sample failed"
    assert "truncation_rate" not in summary.metrics


def test_summarize_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        summarize([])
    row = SampleOutcome(prompt_index=0, sample_index=0, reward=1.0, success=True, answer=None)
    with pytest.raises(ValueError, match="duplicate"):
        summarize([row, row])
    with pytest.raises(ValueError):
        summarize([row], ks=[0])
    with pytest.raises(ValueError):
        SampleOutcome(prompt_index=-1, sample_index=0, reward=None, success=False, answer=None)


def test_summary_is_json_serialisable() -> None:
    import json

    summary = summarize(_hand_built_outcomes())
    assert isinstance(summary, EvalSummary)
    payload = {
        "eval_id": "e1",
        "n_prompts": summary.n_prompts,
        "n_samples": summary.n_samples,
        "metrics": summary.metrics,
    }
    assert json.loads(json.dumps(payload))["metrics"]["pass@1"] == pytest.approx(0.5)


# ---------------------------------------------------------------- comparisons


def test_compare_summaries() -> None:
    a = {"pass@1": 0.5, "pass@1_ci_low": 0.4, "pass@1_ci_high": 0.6, "maj@1": 0.3}
    b = {"pass@1": 0.75, "pass@1_ci_low": 0.7, "pass@1_ci_high": 0.8, "avg@1": 0.2}
    assert compare_summaries(a, b) == [
        MetricDelta(name="pass@1", a=0.5, b=0.75, delta=0.25),
        MetricDelta(name="maj@1", a=0.3, b=None, delta=None),
        MetricDelta(name="avg@1", a=None, b=0.2, delta=None),
    ]


def _rows(rates: dict[int, tuple[int, int]]) -> list[SampleOutcome]:
    """prompt -> (successes, samples) as outcome rows."""
    return [
        SampleOutcome(prompt_index=p, sample_index=s, reward=float(s < c), success=s < c, answer=None)
        for p, (c, n) in rates.items()
        for s in range(n)
    ]


def test_flipped_prompts() -> None:
    a = _rows({0: (0, 2), 1: (2, 2), 2: (1, 2), 3: (1, 1), 5: (1, 2)})
    b = _rows({0: (2, 2), 1: (1, 2), 2: (0, 2), 4: (0, 1), 5: (2, 2)})
    # 0: 0 -> 1 (improved, newly solved); 1: 1 -> 1/2 (regressed: no longer a majority);
    # 2: 1/2 -> 0 (no longer solved, but 1/2 was never a majority); 5: 1/2 -> 1 (improved)
    assert flipped_prompts(a, b) == {
        "improved": [0, 5],
        "regressed": [1],
        "newly_solved": [0],
        "no_longer_solved": [2],
        "only_in_a": [3],
        "only_in_b": [4],
    }


def test_paired_delta_ci() -> None:
    a = {0: 0.0, 1: 1.0, 2: 0.5, 9: 1.0}
    b = {0: 1.0, 1: 1.0, 2: 1.0, 7: 0.0}
    result = paired_delta_ci(a, b, seed=4)
    # shared prompts 0, 1, 2: differences 1, 0, 0.5 -> mean 0.5
    low, high = bootstrap_ci([1.0, 0.0, 0.5], seed=4)
    assert result == PairedDelta(n_shared=3, delta=0.5, ci_low=low, ci_high=high)
    assert paired_delta_ci(a, a, seed=0) == PairedDelta(n_shared=4, delta=0.0, ci_low=0.0, ci_high=0.0)
    with pytest.raises(ValueError):
        paired_delta_ci({0: 1.0}, {1: 1.0}, seed=0)


def test_per_prompt_values() -> None:
    rows = _rows({0: (1, 4), 1: (4, 4)})
    assert per_prompt_values(rows, "pass@1") == {0: 0.25, 1: 1.0}
    # pass@2 for (n=4, c=1): 1 - C(3,2)/C(4,2) = 1/2
    assert per_prompt_values(rows, "pass@2") == {0: pytest.approx(0.5), 1: 1.0}
    with pytest.raises(ValueError):
        per_prompt_values(rows, "pass@8")
    with pytest.raises(ValueError):
        per_prompt_values(rows, "accuracy")
