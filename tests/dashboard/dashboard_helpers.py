"""A store with real runs written through the Store API, as a training process writes them.

`write_runs` writes three runs (oldest first):

- `sft`  succeeded: 40 steps of train/loss, train/lr, train/grad_norm, perf/tokens_per_s,
         a train_state snapshot every 10 steps, events, an eval linked at step 40;
- `rm`   crashed: 12 steps, then the process died (status stored as crashed);
- `grpo` running: 25 steps so far of train/loss, rollout/reward_mean, train/kl and train/grad_norm
         (NaN at step 7), a train_state snapshot and an eval (eval/pass@1) at step 20; tests append more
         steps while it "trains" (`DashboardStore.train_grpo`).

Values are deterministic functions of the step, so tests know every point.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollout.store import EventRecord, MetricRecord, SnapshotRecord, Store

SFT_STEPS = 40
RM_STEPS = 12
GRPO_STEPS = 25


def sft_loss(step: int) -> float:
    return 2.4 * math.exp(-step / 14) + 0.35 + 0.04 * math.sin(step * 1.7)


def grpo_reward(step: int) -> float:
    return 0.9 - 0.7 * math.exp(-step / 18) + 0.03 * math.sin(step * 2.3)


def grpo_metrics(run_id: str, steps: range) -> list[MetricRecord]:
    records = []
    for step in steps:
        records += [
            MetricRecord(run_id, step, "train/loss", 0.05 * math.cos(step / 3) - 0.01 * step / 10),
            MetricRecord(run_id, step, "rollout/reward_mean", grpo_reward(step)),
            MetricRecord(run_id, step, "train/kl", 0.002 * step * (1 + 0.2 * math.sin(step))),
            MetricRecord(run_id, step, "train/grad_norm", float("nan") if step == 7 else 1.5 + math.sin(step)),
        ]
    return records


@dataclass
class DashboardStore:
    path: Path | None  # the SQLite file (None on PostgreSQL)
    store: Store
    sft_id: str
    rm_id: str
    grpo_id: str
    snapshot_ids: list[str] = field(default_factory=list)  # the sft run's, oldest first
    eval_id: str = ""  # the sft run's
    grpo_snapshot_id: str = ""
    grpo_eval_id: str = ""
    grpo_next_seq: int = 0

    def train_grpo(self, steps: range) -> None:
        """The running GRPO run logs more steps (metrics + a train_step event each) and heartbeats."""
        self.store.append_metrics(grpo_metrics(self.grpo_id, steps))
        for step in steps:
            self.log_grpo_event("train_step", {"step": step, "reward_mean": grpo_reward(step)})
        self.store.heartbeat(self.grpo_id)

    def log_grpo_event(self, name: str, fields: dict) -> None:
        self.store.append_events([EventRecord(self.grpo_id, self.grpo_next_seq, time.time(), name, fields)])
        self.grpo_next_seq += 1


def _snapshot(run_id: str, step: int, *, created_at: float, label: str | None = None) -> SnapshotRecord:
    digest = hashlib.sha256(f"{run_id}:{step}".encode()).hexdigest()  # 64 hex, as a real snapshot id
    blobs = {"model.safetensors": {"digest": "b" * 64, "size": 3_276_800}, "optimizer.pt": {"size": 6_553_600}}
    return SnapshotRecord(
        id=digest, run_id=run_id, kind="train_state", step=step, label=label, parent_id=None,
        created_at=created_at, manifest={"blobs": blobs}, metadata={},
    )  # fmt: skip


def write_runs(store: Store, path: Path | None = None) -> DashboardStore:
    sft = store.create_run(algorithm="sft", config_digest="c0ffee" * 10, config_json="{}", name="sft-tiny")
    store.set_run_status(sft.id, "running")
    store.append_metrics(
        [
            record
            for step in range(1, SFT_STEPS + 1)
            for record in (
                MetricRecord(sft.id, step, "train/loss", sft_loss(step)),
                MetricRecord(sft.id, step, "train/lr", 3e-4 * min(1.0, step / 8)),
                MetricRecord(sft.id, step, "train/grad_norm", 4.0 * math.exp(-step / 20) + 0.5),
                MetricRecord(sft.id, step, "perf/tokens_per_s", 5200 + 300 * math.sin(step)),
            )
        ]
    )
    store.append_events(
        [EventRecord(sft.id, 0, time.time(), "run_started", {"algorithm": "sft", "steps": SFT_STEPS})]
        + [
            EventRecord(sft.id, i, time.time(), "train_step", {"step": i, "loss": sft_loss(i)})
            for i in range(1, SFT_STEPS + 1)
        ]
        + [EventRecord(sft.id, SFT_STEPS + 1, time.time(), "run_finished", {"status": "succeeded"})]
    )
    snapshots = [
        _snapshot(sft.id, step, created_at=time.time() - (SFT_STEPS - step), label="final" if step == SFT_STEPS else None)
        for step in (10, 20, 30, 40)
    ]
    for record in snapshots:
        store.add_snapshot(record)
    made_eval = _finished_eval(store, sft.id, step=SFT_STEPS, snapshot_id=snapshots[-1].id, pass_at_1=0.4375)
    store.set_run_status(sft.id, "succeeded")

    rm = store.create_run(algorithm="rm", config_digest="feed" * 16, config_json="{}", name="rm-tiny")
    store.set_run_status(rm.id, "running")
    store.append_metrics(
        [MetricRecord(rm.id, s, "train/loss", 0.69 - 0.02 * s) for s in range(1, RM_STEPS + 1)]
        + [MetricRecord(rm.id, s, "train/accuracy", 0.5 + 0.03 * s) for s in range(1, RM_STEPS + 1)]
    )
    store.set_run_status(rm.id, "crashed", error="no heartbeat for 60 s (process died?)")

    grpo = store.create_run(algorithm="grpo", config_digest="beef" * 16, config_json="{}", name="grpo-tiny")
    store.set_run_status(grpo.id, "running")
    made = DashboardStore(path=path, store=store, sft_id=sft.id, rm_id=rm.id, grpo_id=grpo.id)
    made.snapshot_ids = [s.id for s in snapshots]
    made.eval_id = made_eval
    made.train_grpo(range(1, 21))
    snapshot = _snapshot(grpo.id, 20, created_at=time.time())
    store.add_snapshot(snapshot)
    made.grpo_snapshot_id = snapshot.id
    made.log_grpo_event("snapshot_saved", {"id": snapshot.id, "kind": "train_state", "step": 20})
    made.grpo_eval_id = _finished_eval(store, grpo.id, step=20, snapshot_id=snapshot.id, pass_at_1=0.625)
    store.append_metrics([MetricRecord(grpo.id, 20, "eval/pass@1", 0.625)])
    made.log_grpo_event("eval_finished", {"id": made.grpo_eval_id, "step": 20, "pass@1": 0.625})
    made.train_grpo(range(21, GRPO_STEPS + 1))
    return made


def _finished_eval(store: Store, run_id: str, *, step: int, snapshot_id: str, pass_at_1: float) -> str:
    """An eval during training, finished: 16 prompts x 4 samples (the samples themselves not stored)."""
    evaluation = store.create_eval(
        model=f"snapshot:{snapshot_id}", model_identity=f"snapshot:{snapshot_id}", engine="hf",
        env="arithmetic", data_path="eval_prompts.jsonl", data_digest="d" * 64, n_prompts=16, n=4, seed=0,
        success_threshold=1.0, sampling={"temperature": 1.0}, config_json="{}", name=f"step-{step}",
        run_id=run_id, step=step,
    )  # fmt: skip
    store.set_eval_status(evaluation.id, "running")
    metrics = {"pass@1": pass_at_1, "mean_reward": pass_at_1, "avg@4": float("nan")}
    summary = {"n_prompts": 16, "n_samples": 64, "ks": [1, 2, 4], "metrics": metrics, "not_computable": {}}
    store.set_eval_status(evaluation.id, "succeeded", summary=summary)
    return evaluation.id
