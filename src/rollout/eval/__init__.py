"""Evaluation (SPEC section 9, "Eval harness"): sample N completions per prompt, score, summarise.

    from rollout.eval.metrics import SampleOutcome, summarize, pass_at_k, maj_at_k, bootstrap_ci

`metrics.py` holds the pure estimators (pass@k, pass^k, maj@k, avg@k, bootstrap CIs and the
comparison helpers behind `rollout eval compare`). Importing this package is cheap (stdlib only).
"""
