"""Eval during training: a run config's `[eval]`, run on the weights being trained.

    [eval]                              # rollout.config.PeriodicEvalConfig
    every_steps = 50
    env = "arithmetic"
    data = "../local/data/arithmetic/eval_prompts.jsonl"
    n = 4
    max_tokens = 8

    evals = load_periodic_eval(cfg.eval)          # rows read and checked, env resolved: before the run row
    await evals.maybe_run(step, model, tokenizer, store=store, run_id=run_id, recorder=recorder)

`rollout.run` binds this to a run: each recipe calls `evaluate_if_due(ctx, step, model,
tokenizer)` once per optimizer step, and `finish_training` evaluates the final weights (unless
that step was just evaluated). An eval point is an ordinary eval record (`rollout eval list
--run-id RUN`) with `run_id` and `step` set, its samples stored, and every summary metric
logged as `eval/<metric>` (`eval/pass@1`, `eval/mean_reward`, ...) at that training step.

The model is the live training model, wrapped in an `HFEngine` (no copy) for the eval's
duration: dropout off (`eval()`), no autograd (the engine decodes under `inference_mode`),
back to its previous mode after. GRPO and PPO evaluate the trained policy too, not their
rollout engine: that engine holds the weights from before the step that just ran, and may be
generating the next batch. The eval must not change training: every sample has its own seeded
generator, and the global RNGs are restored afterwards anyway (`rng_state_preserved`), so a
run with `[eval]` ends with the same weights as one without.

`load_periodic_eval` imports no torch: `rollout validate` runs it to check `[eval]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rollout.config import PeriodicEvalConfig
from rollout.eval.config import EvalConfig
from rollout.eval.harness import (
    EvalData,
    Target,
    check_rows_with_env,
    create_eval_record,
    execute_eval,
    load_eval_data,
)
from rollout.eval.metrics import EvalSummary
from rollout.models.load import hf_model
from rollout.observe import RunRecorder
from rollout.rl.envs import resolve_env
from rollout.rng import rng_state_preserved
from rollout.store.base import Store


@dataclass
class PeriodicEval:
    """One `[eval]` of a training run: its cadence, data and sampling, and the last step it ran at."""

    every_steps: int
    spec: EvalConfig  # the harness's view of the eval (env, n, seed, sampling); no target: the policy is it
    data: EvalData
    last_step: int | None = None

    def due(self, step: int, *, final: bool = False) -> bool:
        """On the cadence (or `final`: the last weights of the run), and not already evaluated."""
        return step != self.last_step and (final or step % self.every_steps == 0)

    async def maybe_run(
        self, step: int, model: Any, tokenizer: Any, *, store: Store, run_id: str, recorder: RunRecorder,
        final: bool = False,
    ) -> EvalSummary | None:
        """Evaluate `model` as it is after optimizer step `step` when `due`; None when it isn't."""
        if not self.due(step, final=final):
            return None
        from rollout.inference.hf_engine import HFEngine  # torch: only once a model is evaluated

        self.last_step = step
        base = hf_model(model)  # the transformers model (LoRA layers stay active under peft)
        engine = HFEngine(base, tokenizer, model_name=f"run-{run_id}", max_batch_size=self.spec.max_batch_size)
        target = Target("hf", f"run {run_id} step {step}", f"run:{run_id}:step:{step}")
        record = create_eval_record(store, self.spec, target, self.data, run_id=run_id, step=step)
        recorder.event("eval_start", step=step, eval_id=record.id)
        with rng_state_preserved(), _eval_mode(base):
            # execute_eval runs its own event loop: on a worker thread, while this loop waits for it
            summary = await asyncio.to_thread(execute_eval, store, record, self.spec, engine, self.data)
        recorder.metrics(step, {f"eval/{name}": value for name, value in summary.metrics.items()})
        recorder.event(
            "eval_end", step=step, eval_id=record.id, pass_at_1=summary.metrics.get("pass@1"),
            mean_reward=summary.metrics.get("mean_reward"),
        )
        return summary


def load_periodic_eval(cfg: PeriodicEvalConfig) -> PeriodicEval:
    """Resolve the env, read the rows (the first `max_prompts`) and start an episode on each, so a
    bad env or row fails before any run row exists or any model loads."""
    env_factory = resolve_env(cfg.env)
    spec = EvalConfig.model_construct(  # validated already: the fields share their types (eval/fields.py)
        name=None, env=cfg.env, data=cfg.data, n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
        max_tokens=cfg.max_tokens, stop=list(cfg.stop), max_turns=cfg.max_turns, seed=cfg.seed,
        success_threshold=cfg.success_threshold, max_batch_size=cfg.max_batch_size,
    )
    data = load_eval_data(spec, env_factory)
    if cfg.max_prompts is not None:
        lines = data.lines[: cfg.max_prompts] if data.lines is not None else None
        data = EvalData(data.path, data.digest, data.rows[: cfg.max_prompts], lines)
    check_rows_with_env(data, env_factory)
    return PeriodicEval(cfg.every_steps, spec, data)


@contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """`model.eval()` for the block (no dropout while sampling), then the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
