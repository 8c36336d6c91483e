"""Eval during training: a run config's `[eval]` logs `eval/<metric>` at its steps, stores eval
records linked to the run, and leaves training byte-for-byte as it was.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/eval/test_eval_during_training.py -q     # ~1 min on 2 cores

The tiny model, 4 SFT steps (LoRA with dropout, so training draws from the global torch RNG and
an eval that disturbed it would change the weights), 2 GRPO steps; evals of 8 prompts x 2 samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.config import load_config
from rollout.eval.during_training import PeriodicEval
from rollout.store import open_store

ROLLOUT = Path(sys.executable).parent / "rollout"
EVAL = """
[eval]
every_steps = {every}
env = "arithmetic"
data = "{data}"
max_prompts = 8
n = 2
max_tokens = 4
seed = 3
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("eval-during-training")
    init_tiny_model(root / "tiny")
    write_arithmetic_dataset(root / "arith", num_train=64, num_eval=16)
    return root


def run_config(workspace: Path, dest: Path, kind: str, *, every: int | None) -> Path:
    """A 4-step SFT (LoRA, dropout 0.1), 2-step GRPO or rm config on the tiny model, `[eval]` if `every`."""
    block = {
        "sft": f"""minibatch_size = 4
[algorithm.sft.budget]
max_steps = 4
[algorithm.sft.dataset]
path = "{workspace}/arith/sft.jsonl"
[algorithm.sft.lora]
r = 4
dropout = 0.1
""",
        "grpo": f"""minibatch_size = 2
num_generations = 2
max_tokens = 4
[[algorithm.grpo.rewards]]
name = "arithmetic_correct"
[algorithm.grpo.budget]
max_steps = 2
[algorithm.grpo.dataset]
path = "{workspace}/arith/prompts.jsonl"
""",
        "rm": f"""minibatch_size = 4
[algorithm.rm.budget]
max_steps = 2
[algorithm.rm.dataset]
path = "{workspace}/arith/pref.jsonl"
""",
    }[kind]
    text = f"""schema_version = 1
seed = 0
[storage.embedded]
path = "{dest}/rollout.db"
[storage.objects]
path = "{dest}/objects"
[algorithm]
kind = "{kind}"
[algorithm.{kind}]
{block}[algorithm.{kind}.base_model]
uri = "{workspace}/tiny"
[algorithm.{kind}.optimizer]
kind = "adamw"
lr = 1e-2
"""
    if every is not None:
        text += EVAL.format(every=every, data=f"{workspace}/arith/eval_prompts.jsonl")
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{kind}.toml"
    path.write_text(text)
    return path


def final_weights_digest(config: Path, run_id: str) -> str:
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        [final] = store.list_snapshots(run_id=run_id, kind="train_state", limit=1)
        return str(final.manifest["blobs"]["model"]["digest"])
    finally:
        store.close()


def eval_points(config: Path, run_id: str) -> tuple[dict[int, float], list[tuple[int | None, str, int]]]:
    """({step: eval/pass@1}, [(step, status, samples stored) of each eval record of the run, by step])."""
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        logged = {m.step: m.value for m in store.read_metrics(run_id, name="eval/pass@1")}
        records = sorted(store.list_evals(run_id=run_id), key=lambda r: r.step or 0)
        counts = store.count_eval_samples([r.id for r in records])
        return logged, [(r.step, r.status, counts.get(r.id, 0)) for r in records]
    finally:
        store.close()


def test_sft_logs_eval_metrics_at_its_steps_and_keeps_the_weights(workspace: Path, tmp_path: Path) -> None:
    from rollout.algorithms.sft import train_sft

    with_eval = run_config(workspace, tmp_path / "with", "sft", every=2)
    without = run_config(workspace, tmp_path / "without", "sft", every=None)
    a = train_sft(load_config(with_eval))
    b = train_sft(load_config(without))

    logged, records = eval_points(with_eval, a.run_id)
    assert sorted(logged) == [2, 4]  # on the cadence; the final step (4) is not evaluated twice
    assert all(0.0 <= v <= 1.0 for v in logged.values())
    assert records == [(2, "succeeded", 16), (4, "succeeded", 16)]  # 8 prompts x n = 2, linked to the run
    cfg = load_config(with_eval)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    names = {m.name for m in store.read_metrics(a.run_id) if m.step == 2}
    [record] = [r for r in store.list_evals(run_id=a.run_id) if r.step == 4]
    store.close()
    assert {"eval/pass@1", "eval/mean_reward", "train/loss"} <= names
    assert record.model == f"run {a.run_id} step 4" and record.summary is not None
    assert record.summary["metrics"]["pass@1"] == logged[4]

    assert final_weights_digest(with_eval, a.run_id) == final_weights_digest(without, b.run_id)

    out = _rollout("eval", "--resume", record.id, "--storage-path", str(cfg.storage.embedded.path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"ran during training run {a.run_id} (step 4); it can't be resumed" in out.stderr


def test_grpo_logs_eval_metrics(workspace: Path, tmp_path: Path) -> None:
    from rollout.algorithms.grpo import train_grpo

    config = run_config(workspace, tmp_path, "grpo", every=1)
    result = train_grpo(load_config(config))
    logged, records = eval_points(config, result.run_id)
    assert sorted(logged) == [1, 2]
    assert [(step, status) for step, status, _ in records] == [(1, "succeeded"), (2, "succeeded")]


def test_due_on_the_cadence_and_once_at_the_end() -> None:
    evals = PeriodicEval(every_steps=3, spec=None, data=None)  # type: ignore[arg-type]
    assert [s for s in range(1, 8) if evals.due(s)] == [3, 6]
    assert evals.due(7, final=True)  # the last weights, off the cadence
    evals.last_step = 6
    assert not evals.due(6, final=True)  # just evaluated


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1")
    return subprocess.run([str(ROLLOUT), *args], capture_output=True, text=True, env=env, timeout=120)


def _validate(config: Path) -> subprocess.CompletedProcess[str]:
    return _rollout("validate", "--config", str(config))


def test_validate_refuses_eval_on_rm_and_locates_a_missing_eval_file(workspace: Path, tmp_path: Path) -> None:
    rm = run_config(workspace, tmp_path / "rm", "rm", every=2)
    out = _validate(rm)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    line = rm.read_text().splitlines().index("[eval]") + 1
    assert out.stderr.startswith(f"error: {rm}:{line}: eval: ") and "rm trains a model that does not generate" in out.stderr

    sft = run_config(workspace, tmp_path / "sft", "sft", every=2)
    sft.write_text(sft.read_text().replace("eval_prompts.jsonl", "missing.jsonl"))
    out = _validate(sft)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "eval.data: not found" in out.stderr

    sft.write_text(sft.read_text().replace("missing.jsonl", "eval_prompts.jsonl"))
    out = _validate(sft)
    assert out.returncode == 0, out.stderr
    assert "eval=" in out.stdout and "prompts=8 every_steps=2" in out.stdout

    # a sidecar env (SPEC section 11: wherever an env is accepted): validate neither starts it nor
    # reads rows through it (no plugins); `plan` and `train` do
    marker = tmp_path / "started"
    script = tmp_path / "env_sidecar.py"
    script.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    sidecar = f'env = {{kind = "sidecar", command = {json.dumps([sys.executable, str(script)])}}}'
    sft.write_text(sft.read_text().replace('env = "arithmetic"', sidecar))
    out = _validate(sft)
    assert out.returncode == 0, out.stderr
    assert "eval=" in out.stdout and out.stdout.rstrip().endswith("every_steps=2") and "prompts=" not in out.stdout
    assert not marker.exists()
