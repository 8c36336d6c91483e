"""Evaluation (SPEC section 9, "Eval harness"): sample N completions per prompt, score, summarise.

    from rollout.eval.metrics import SampleOutcome, summarize, pass_at_k, maj_at_k, bootstrap_ci
    from rollout.eval.runner import run_eval              # async: sampler + env + rows -> samples + summary
    from rollout.eval.harness import execute_eval         # config + store: run, resume, finish an eval

`metrics.py` holds the pure estimators (pass@k, pass^k, maj@k, avg@k, bootstrap CIs and the
comparison helpers behind `rollout eval compare`); `runner.py` draws and scores the samples
(seeded per (prompt, sample)); `config.py` is the `[eval]` block; `harness.py` ties config,
engine and store together for `rollout eval`; `compare.py` builds `eval compare`'s report;
`during_training.py` runs a training config's `[eval]` on the live policy (`fields.py`: the
sampling fields both `[eval]` tables share).
Importing this package is cheap (stdlib only).
"""
