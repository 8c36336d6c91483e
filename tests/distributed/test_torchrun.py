"""torchrun learners on the CPU: the real `rollout train` relaunching itself as 2 gloo ranks.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/pytest tests/distributed -q

- SFT (FSDP2), DPO (FSDP2 and DDP), KTO (FSDP2) and RM (FSDP2) on 2 ranks give one process's per-step losses
  (same global batch) within 1e-5 relative and its final weights within 1e-5; SFT's eval during
  training samples the same completions, and its export holds the same weights;
- a world-size-2 snapshot resumes at world size 1 (the uninterrupted one-process numbers) and at
  world size 2 (byte-identical to the uninterrupted world-size-2 run);
- SIGKILL of either rank ends the job non-zero within 30 s and the run is `failed`, never
  left `running`;
- GRPO (FSDP2) on 2 ranks, each sampling half of every step's groups on its own batch-invariant
  engine, samples the groups one batch-invariant process samples (same mean rewards), gives its
  per-step losses within 1e-5 and its final weights within 1e-5; its world-size-2 snapshot
  resumes at 2 (byte-identical) and at 1 (the one-process numbers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import (
    assert_close_runs,
    cli_env,
    distributed_block,
    planned_run_cli,
    run_id_of,
    train_cli,
    write_config,
)
from safetensors.torch import load as load_safetensors

from rollout.config import load_config
from rollout.snapshots import read_snapshot_blob
from rollout.store import open_object_store, open_store

N = 4  # steps; snapshots at N/2 and N


def _trained(config: Path, run_id: str) -> tuple[str, dict[int, float], dict, dict]:
    """(status, {step: train/loss}, {step: snapshot}, the last snapshot's model tensors)."""
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    objects = open_object_store("fs", path=cfg.storage.objects.path)
    try:
        run = store.get_run(run_id)
        losses = {m.step: m.value for m in store.read_metrics(run_id, name="train/loss")}
        snaps = {s.step: s for s in store.list_snapshots(run_id=run_id, kind="train_state")}
        weights = load_safetensors(read_snapshot_blob(objects, snaps[max(snaps)], "model")) if snaps else {}
        return run.status, losses, snaps, weights
    finally:
        store.close()


def _train_local(config: Path, resume: str | None = None) -> str:
    from rollout.algorithms.registry import ALGORITHMS

    cfg = load_config(config)
    return ALGORITHMS[cfg.algorithm.kind].load_train()(cfg, resume=resume).run_id


def _sft_extra(dest: Path, inputs) -> str:
    """An export and an [eval] every N/2 steps (4 prompts x 2 samples of the eval set)."""
    prompts = inputs.sft.parent / "eval_prompts.jsonl"
    return (f'[algorithm.sft.export]\ndir = "{dest}/export"\n'
            f'[eval]\nevery_steps = {N // 2}\nenv = "arithmetic"\ndata = "{prompts}"\nmax_prompts = 4\n'
            f"n = 2\nmax_tokens = 6\n")


@pytest.fixture(scope="module")
def sft_runs(inputs, tmp_path_factory):
    """The same SFT run twice: one process (in this one), and 2 FSDP2 ranks through `rollout plan -o
    LOCK` and `rollout run --plan LOCK`, which relaunches itself through torchrun as `rollout train`
    does (the other tests' runs)."""
    root = tmp_path_factory.mktemp("sft")
    one = write_config(root / "one", "sft", inputs, distributed=distributed_block(None), max_steps=N,
                       every_steps=N // 2, extra=_sft_extra(root / "one", inputs))
    two = write_config(root / "two", "sft", inputs, distributed=distributed_block(2), max_steps=N,
                       every_steps=N // 2, extra=_sft_extra(root / "two", inputs))
    out = planned_run_cli(two)
    assert out.stdout.startswith(f"plan {two.parent / 'plan.lock'}: every pinned file"), out.stdout
    return (one, _train_local(one)), (two, run_id_of(out))


def _eval_completions(config: Path, run_id: str) -> dict[int, list[str]]:
    """{training step: the completions its eval sampled, in (prompt, sample) order}."""
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        return {e.step: [x.completion for x in store.read_eval_samples(e.id)] for e in store.list_evals(run_id=run_id)}
    finally:
        store.close()


def test_sft_two_ranks_match_one_process(sft_runs):
    (one, run_one), (two, run_two) = sft_runs
    status_one, losses_one, snaps_one, weights_one = _trained(one, run_one)
    status_two, losses_two, snaps_two, weights_two = _trained(two, run_two)
    assert status_one == status_two == "succeeded"
    assert sorted(losses_two) == list(range(1, N + 1)) and sorted(snaps_two) == [N // 2, N]
    assert_close_runs(losses_one, losses_two, weights_one, weights_two)
    assert losses_two[N] < losses_two[1]  # it trained
    # rank 0 alone wrote: one run, one events file
    store = open_store("embedded", path=load_config(two).storage.embedded.path)
    try:
        assert [r.id for r in store.list_runs()] == [run_two]
    finally:
        store.close()
    assert [p.name for p in (two.parent / "runs").iterdir()] == [run_two]
    events = [json.loads(line) for line in (two.parent / "runs" / run_two / "events.jsonl").read_text().splitlines()]
    assert [e["name"] for e in events].count("train_start") == 1
    assert [e["fields"] for e in events if e["name"] == "process_group"] == [{"world_size": 2, "sharding": "fsdp"}]
    # eval during training (on rank 0, from the gathered weights) samples what one process samples
    completions = _eval_completions(two, run_two)
    assert sorted(completions) == [N // 2, N] and all(len(c) == 8 for c in completions.values())
    assert completions == _eval_completions(one, run_one)
    # the export (rank 0, gathered) holds the trained weights
    from safetensors.torch import load_file

    exported, expected = load_file(two.parent / "export" / "model.safetensors"), load_file(
        one.parent / "export" / "model.safetensors")
    assert exported.keys() == expected.keys()
    for name in exported:
        torch.testing.assert_close(exported[name], expected[name], rtol=0, atol=1e-5, msg=name)


def test_world_size_2_snapshot_resumes_at_1_and_at_2(sft_runs, inputs):
    (one, run_one), (two, run_two) = sft_runs
    _, losses_one, _, weights_one = _trained(one, run_one)
    _, losses_two, snaps_two, _ = _trained(two, run_two)
    middle = snaps_two[N // 2].id

    # world size 1, from the world-size-2 snapshot (in its store): the one-process numbers
    local = write_config(two.parent / "as-one", "sft", inputs, distributed=distributed_block(None),
                         max_steps=N, every_steps=N // 2, store=two.parent)
    resumed = _train_local(local, resume=middle[:12])
    _, losses_r1, snaps_r1, weights_r1 = _trained(local, resumed)
    assert sorted(snaps_r1) == [N]
    assert_close_runs({s: losses_one[s] for s in losses_r1}, losses_r1, weights_one, weights_r1)
    assert sorted(losses_r1) == list(range(N // 2 + 1, N + 1))

    # world size 2 again: byte-identical to the uninterrupted world-size-2 run
    run_r2 = run_id_of(train_cli("sft", two, "--resume", middle[:12]))
    status, losses_r2, snaps_r2, _ = _trained(two, run_r2)
    assert status == "succeeded"
    a, b = snaps_two[N].manifest["blobs"], snaps_r2[N].manifest["blobs"]
    assert a["model"]["digest"] == b["model"]["digest"], "weights differ after a world-size-2 resume"
    assert a["optimizer"]["digest"] == b["optimizer"]["digest"], "optimizer state differs after resume"
    assert {s: losses_two[s] for s in losses_r2} == losses_r2
    assert snaps_r2[N].parent_id == middle


@pytest.mark.parametrize(("kind", "sharding"), [("dpo", "fsdp"), ("dpo", "ddp"), ("rm", "fsdp"), ("kto", "fsdp")])
def test_preference_two_ranks_match_one_process(kind, sharding, inputs, tmp_path):
    one = write_config(tmp_path / "one", kind, inputs, distributed=distributed_block(None), max_steps=N,
                       every_steps=N)
    two = write_config(tmp_path / "two", kind, inputs, distributed=distributed_block(2, sharding), max_steps=N,
                       every_steps=N)
    run_two = run_id_of(train_cli(kind, two))
    run_one = _train_local(one)
    status_one, losses_one, _, weights_one = _trained(one, run_one)
    status_two, losses_two, _, weights_two = _trained(two, run_two)
    assert status_one == status_two == "succeeded"
    # RM: Adam turns the float noise of a few near-zero gradients into up to ~lr-sized differences
    # (6 of 1.05M weights beyond 1e-5 here, the largest 1e-4, while the losses agree to 1e-7)
    assert_close_runs(losses_one, losses_two, weights_one, weights_two, atol=5e-4 if kind == "rm" else 1e-5)
    assert losses_two[N] != losses_two[1]  # it trained


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker with RANK=`rank` among the launcher's descendants (torchrun's children)."""
    for pid in _descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID=" in b"\0".join(env):
            return pid
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_fails_the_job_promptly(rank, inputs, tmp_path):
    config = write_config(tmp_path, "sft", inputs, distributed=distributed_block(2), max_steps=10_000, every_steps=10_000)
    db = tmp_path / "rollout.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.cli.main", "train", "sft", "--config", str(config)],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        run_id = None
        while run_id is None:  # until the job has taken a step
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the job took no step"
            time.sleep(0.5)
            if db.exists():
                store = open_store("embedded", path=db)
                try:
                    runs = store.list_runs()
                    if runs and store.read_metrics(runs[0].id, name="train/loss"):
                        run_id = runs[0].id
                finally:
                    store.close()
        victim = _rank_pid(proc.pid, rank)
        assert victim is not None, "rank process not found"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert took < 30, f"the job took {took:.1f} s to fail"
    assert f"run {run_id} is marked failed" in stderr or "error: " in stderr
    show = subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", "runs", "show", run_id, "--json", "--storage-path", str(db)],
        env=cli_env(), capture_output=True, text=True, timeout=60,
    )
    assert show.returncode == 0, show.stderr
    record = json.loads(show.stdout)
    run = record.get("run", record)
    assert run["status"] == "failed"
    assert run["error"]


# --------------------------------------------------------------------------- GRPO

ROOT = Path(__file__).resolve().parents[2]
GRPO_SMALL = {
    "minibatch_size = 16": "minibatch_size = 4",
    "num_generations = 8": "num_generations = 4",
    "gradient_accumulation = 1": "gradient_accumulation = 2",
    "max_tokens = 6": "max_tokens = 4",
    "max_steps = 250": f"max_steps = {N}",
    "every_steps = 50": f"every_steps = {N // 2}",
    "dynamic_sampling = true": "dynamic_sampling = false",
    "num_iterations = 1": "num_iterations = 2",  # a second step on each batch: old log-probs, a ratio != 1
    "beta = 0.0": "beta = 0.04",  # a KL term against a reference copy of the model
    'name = "arithmetic_correct"': 'name = "ray_plugins:length_or_kill"',  # length: a signal the tiny model has
}


PPO_SMALL = {
    **{k: v for k, v in GRPO_SMALL.items() if k.split(" =")[0] not in ("max_steps", "dynamic_sampling", "beta")},
    "max_steps = 200": f"max_steps = {N}",
}


def _grpo_config(
    dest: Path, inputs, distributed: str, store: Path | None = None, extra: dict[str, str] | None = None,
    kind: str = "grpo",
) -> Path:
    """examples/<kind>-tiny.toml (grpo or ppo), small (4 prompts x 4 samples a step, 2 micro-batches),
    on the tiny model, one torch thread, batch-invariant sampling, under `distributed`; then
    `extra`'s replacements."""
    text = (ROOT / "examples" / f"{kind}-tiny.toml").read_text()
    for old, new in {**(GRPO_SMALL if kind == "grpo" else PPO_SMALL), **(extra or {})}.items():
        assert old in text, old
        text = text.replace(old, new)
    store = store or dest
    text = text.replace('"../local/models/sft-warmup"', f'"{inputs.model}"')
    text = text.replace('"../local/data/arithmetic/prompts.jsonl"', f'"{inputs.sft.parent / "prompts.jsonl"}"')
    text = text.replace(f'"../local/models/{kind}-tiny"', f'"{dest}/export"')
    text = text.replace('"../local/', f'"{store}/')
    text = text.replace('[distributed]\nkind = "local"\n',
                        f'[backend]\nnum_threads = 1\nbatch_invariant = true\n\n{distributed}')
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{kind}.toml").write_text(text)
    return dest / f"{kind}.toml"


def _grpo_cli(config: Path, *args: str, kind: str = "grpo") -> subprocess.CompletedProcess[str]:
    """`rollout train grpo` (or `kind`) in a fresh process; the ranks import the reward from ray_plugins here."""
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", "train", kind, "--config", str(config), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )


def _rewards(config: Path, run_id: str) -> list[float]:
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        metrics = store.read_metrics(run_id, name="rollout/reward_mean")
    finally:
        store.close()
    return [m.value for m in sorted(metrics, key=lambda m: m.step)]


@pytest.fixture(scope="module")
def grpo_runs(inputs, tmp_path_factory):
    """GRPO twice: one process (in this one, batch-invariant sampling) and 2 FSDP2 ranks."""
    root = tmp_path_factory.mktemp("grpo")
    one = _grpo_config(root / "one", inputs, distributed_block(None))
    two = _grpo_config(root / "two", inputs, distributed_block(2))
    return (one, _train_local(one)), (two, run_id_of(_grpo_cli(two)))


def test_grpo_two_ranks_match_one_process(grpo_runs):
    (one, run_one), (two, run_two) = grpo_runs
    status_one, losses_one, _, weights_one = _trained(one, run_one)
    status_two, losses_two, snaps_two, weights_two = _trained(two, run_two)
    assert status_one == status_two == "succeeded"
    assert sorted(losses_two) == list(range(1, N + 1)) and sorted(snaps_two) == [N // 2, N]
    # the ranks sampled the groups one process samples (each rank half of them: 2 of the 4 a step)
    assert _rewards(two, run_two) == _rewards(one, run_one)
    # the first step on a batch has ratio 1: its loss is -mean(advantage) = 0 up to rounding (~1e-7),
    # plus beta x KL (0 at step 1, ~1e-3 at step 3, where the ranks' sums differ by ~5e-8)
    assert_close_runs(losses_one, losses_two, weights_one, weights_two, loss_atol=1e-6)
    assert min(abs(losses_two[s]) for s in (2, 4)) > 1e-3  # the second one is not
    store = open_store("embedded", path=load_config(two).storage.embedded.path)
    try:
        assert [r.id for r in store.list_runs()] == [run_two]  # rank 0 alone wrote
        metrics = store.read_metrics(run_two)
    finally:
        store.close()
    by_rank = [[m.value for m in metrics if m.name == f"rollout/rank/{r}/groups"] for r in (0, 1)]
    assert by_rank == [[2.0] * N, [2.0] * N]  # each rank made half of every step's groups
    assert min(m.value for m in metrics if m.name == "train/grad_norm") > 0  # the weights moved every step


def test_grpo_world_size_2_resumes_at_2_and_at_1(grpo_runs, inputs):
    (one, run_one), (two, run_two) = grpo_runs
    _, losses_one, _, weights_one = _trained(one, run_one)
    _, losses_two, snaps_two, _ = _trained(two, run_two)
    middle = snaps_two[N // 2].id

    run_r2 = run_id_of(_grpo_cli(two, "--resume", middle[:12]))
    status, losses_r2, snaps_r2, _ = _trained(two, run_r2)
    assert status == "succeeded"
    a, b = snaps_two[N].manifest["blobs"], snaps_r2[N].manifest["blobs"]
    assert a["model"]["digest"] == b["model"]["digest"], "weights differ after a world-size-2 resume"
    assert {s: losses_two[s] for s in losses_r2} == losses_r2

    local = _grpo_config(two.parent / "as-one", inputs, distributed_block(None), store=two.parent)
    resumed = _train_local(local, resume=middle[:12])
    _, losses_r1, _, weights_r1 = _trained(local, resumed)
    assert sorted(losses_r1) == list(range(N // 2 + 1, N + 1))
    assert_close_runs({s: losses_one[s] for s in losses_r1}, losses_r1, weights_one, weights_r1, loss_atol=1e-6)


def test_grpo_micro_batches_of_one_row_on_two_ddp_ranks(inputs, tmp_path):
    """16 micro-batches of one row a step: rank 1 has no row of its own in any of them and runs a
    row that counts no token (each rank must run every micro-batch), so the step is still one
    process's."""
    one_row = {"gradient_accumulation = 1": "gradient_accumulation = 16"}
    one = _grpo_config(tmp_path / "one", inputs, distributed_block(None), extra=one_row)
    two = _grpo_config(tmp_path / "two", inputs, distributed_block(2, "ddp"), extra=one_row)
    run_two = run_id_of(_grpo_cli(two))
    run_one = _train_local(one)
    _, losses_one, _, weights_one = _trained(one, run_one)
    status, losses_two, _, weights_two = _trained(two, run_two)
    assert status == "succeeded"
    assert _rewards(two, run_two) == _rewards(one, run_one)
    assert_close_runs(losses_one, losses_two, weights_one, weights_two, loss_atol=1e-6)
    assert min(abs(losses_two[s]) for s in (2, 4)) > 1e-3


# --------------------------------------------------------------------------- PPO


def test_ppo_two_ddp_ranks_match_one_process(inputs, tmp_path):
    """PPO (policy and value model, value_lr's own parameter group) on 2 DDP ranks: the ranks sample
    half of every round each and evaluate the whole batch alike, so the rewards are one process's,
    and the losses and weights agree up to the summed gradients' float reassociation."""
    one = _grpo_config(tmp_path / "one", inputs, distributed_block(None), kind="ppo")
    two = _grpo_config(tmp_path / "two", inputs, distributed_block(2, "ddp"), kind="ppo")
    out = _grpo_cli(two, kind="ppo")
    run_two = run_id_of(out)
    run_one = _train_local(one)
    _, losses_one, _, weights_one = _trained(one, run_one)
    status, losses_two, snaps_two, weights_two = _trained(two, run_two)
    assert status == "succeeded" and sorted(snaps_two) == [N // 2, N]
    assert _rewards(two, run_two) == _rewards(one, run_one)
    assert_close_runs(losses_one, losses_two, weights_one, weights_two, loss_atol=1e-6)
    assert min(abs(v) for v in losses_two.values()) > 1e-4  # the value loss: never zero
    assert any(name.startswith("value.") for name in weights_two)  # the snapshot holds the value model too
    store = open_store("embedded", path=load_config(two).storage.embedded.path)
    try:
        metrics = store.read_metrics(run_two)
    finally:
        store.close()
    by_rank = [[m.value for m in metrics if m.name == f"rollout/rank/{r}/groups"] for r in (0, 1)]
    assert by_rank == [[2.0] * N, [2.0] * N]  # each rank made half of every step's groups


def test_ppo_under_fsdp_is_refused_at_plan_time(inputs, tmp_path):
    from rollout.cli.config_cmds import check_runtime
    from rollout.errors import ConfigError

    path = _grpo_config(tmp_path, inputs, distributed_block(2, "fsdp"), kind="ppo")
    with pytest.raises(ConfigError, match=r'ppo.toml:\d+: distributed.sharding: ppo runs under sharding = "ddp"'):
        check_runtime(load_config(path), source=path)
