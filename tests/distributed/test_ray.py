"""`[distributed] kind = "ray"`: GRPO with rollout worker actors on a local Ray cluster ends with
the same weights as `kind = "local"`, also when a worker is `ray.kill`ed mid-step, and PPO too; plan-time
errors of a bad `[distributed]` block. One Ray cluster for the module, stopped at the end.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/distributed/test_ray.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from dist_helpers import assert_close_runs
from ray_plugins import KILL_FLAG_ENV
from safetensors.torch import load as load_safetensors

from rollout.config import RayDistributedConfig, load_config, parse_config
from rollout.errors import ConfigError
from rollout.snapshots import read_snapshot_blob
from rollout.store import open_object_store, open_store

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
N = 4
SMALL = {
    "minibatch_size = 16": "minibatch_size = 3",
    "num_generations = 8": "num_generations = 4",
    "max_tokens = 6": "max_tokens = 4",
    "max_steps = 250": f"max_steps = {N}",
    "every_steps = 50": f"every_steps = {N}",
    "dynamic_sampling = true": "dynamic_sampling = false",
    'name = "arithmetic_correct"': 'name = "ray_plugins:length_or_kill"',
}
PPO_SMALL = {**{k: v for k, v in SMALL.items() if "dynamic" not in k and "250" not in k},
             "max_steps = 200": f"max_steps = {N}"}
RAY = '[distributed]\nkind = "ray"\nnum_rollout_workers = 2\n'


def _config(dest: Path, inputs, distributed: str, extra: dict[str, str] | None = None, kind: str = "grpo") -> Path:
    """examples/<kind>-tiny.toml, small, on the tiny model, one torch thread, under `distributed`."""
    text = (ROOT / "examples" / f"{kind}-tiny.toml").read_text()
    for old, new in {**(SMALL if kind == "grpo" else PPO_SMALL), **(extra or {})}.items():
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace('"../local/models/sft-warmup"', f'"{inputs.model}"')
    text = text.replace('"../local/data/arithmetic/prompts.jsonl"', f'"{inputs.prompts}"')
    text = text.replace(f'"../local/models/{kind}-tiny"', f'"{dest}/export"')
    text = text.replace('"../local/', f'"{dest}/')
    text = text.replace('[distributed]\nkind = "local"\n', f'[backend]\nnum_threads = 1\nbatch_invariant = true\n\n{distributed}')
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "run.toml").write_text(text)
    return dest / "run.toml"


class Final(NamedTuple):
    digest: str
    metrics: list
    events: list
    weights: dict


def _final(cfg, run_id) -> Final:
    """The final snapshot's model digest and tensors (its blob read back, verified), the run's
    metrics and events."""
    store = open_store("embedded", path=cfg.storage.embedded.path)
    objects = open_object_store("fs", path=cfg.storage.objects.path)
    try:
        [snap] = [s for s in store.list_snapshots(run_id=run_id, kind="train_state") if s.step == N]
        weights = load_safetensors(read_snapshot_blob(objects, snap, "model"))  # there, and matching its digest
        return Final(snap.manifest["blobs"]["model"]["digest"], store.read_metrics(run_id), store.read_events(run_id),
                     weights)
    finally:
        store.close()


def _assert_same_run(ray_run: Final, local: Final, *, losses: bool = True) -> None:
    """Byte-identical weights, the same rewards and (unless asked not to) the same losses: the
    batch-invariant engine gives a group bitwise the same tokens and log-probs whichever groups
    share its batch (`tests/inference/test_lean_decoder.py` checks that on this CPU, at one and two
    threads), so a Ray worker's groups are the local run's."""
    assert _values(ray_run.metrics, "rollout/reward_mean") == _values(local.metrics, "rollout/reward_mean")
    assert ray_run.digest == local.digest
    if losses:
        assert _values(ray_run.metrics, "train/loss") == _values(local.metrics, "train/loss")


def _values(metrics, name):
    return [m.value for m in sorted(metrics, key=lambda m: m.step) if m.name == name]


@pytest.fixture(scope="module")
def prompts_inputs(inputs, tmp_path_factory):
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    data = write_arithmetic_dataset(tmp_path_factory.mktemp("ray-arith"))

    class Inputs:
        model = inputs.model
        prompts = Path(data["prompts"]).resolve()

    return Inputs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster for the module (the workers import ray_plugins from here); after it
    stops, no Ray process is left."""
    flag = tmp_path_factory.mktemp("ray-flag") / "kill-worker-1"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", KILL_FLAG_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(ROOT / "src"), saved["PYTHONPATH"]) if p)
    os.environ[KILL_FLAG_ENV] = str(flag)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        yield flag
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _assert_no_ray_processes()


def _assert_no_ray_processes():
    deadline = time.monotonic() + 20
    while True:
        out = subprocess.run(["ps", "-eo", "pid,ppid,comm"], capture_output=True, text=True).stdout
        left = [line for line in out.splitlines() if any(n in line for n in ("raylet", "gcs_server"))]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, left


@pytest.fixture(scope="module")
def local_run(prompts_inputs, tmp_path_factory):
    from rollout.algorithms.grpo import train_grpo

    cfg = load_config(_config(tmp_path_factory.mktemp("grpo-local"), prompts_inputs, '[distributed]\nkind = "local"\n'))
    return _final(cfg, train_grpo(cfg).run_id)


def test_ray_grpo_weights_match_local(cluster, local_run, prompts_inputs, tmp_path):
    from rollout.algorithms.grpo import train_grpo

    cfg = load_config(_config(tmp_path, prompts_inputs, RAY))
    ray_run = _final(cfg, train_grpo(cfg).run_id)
    metrics, events = ray_run.metrics, ray_run.events
    _assert_same_run(ray_run, local_run)
    assert min(abs(v) for v in _values(local_run.metrics, "train/grad_norm")) > 0  # the weights moved every step
    groups = [sum(_values(metrics, f"rollout/worker/{w}/groups")) for w in (0, 1)]
    assert sum(groups) == 3 * N and min(groups) >= 1  # both workers took groups; every group once
    assert _values(metrics, "rollout/workers_alive") == [2.0] * N
    [started] = [e for e in events if e.name == "rollout_workers_started"]
    assert started.fields["workers"] == 2
    assert not [e for e in events if e.name == "rollout_worker_died"]


def test_killed_worker_groups_rerun_elsewhere(cluster, local_run, prompts_inputs, tmp_path):
    from rollout.algorithms.grpo import train_grpo

    cluster.write_text("kill")  # worker 1 ray.kills itself on its 2nd lease
    cfg = load_config(_config(tmp_path, prompts_inputs, RAY))
    ray_run = _final(cfg, train_grpo(cfg).run_id)
    metrics, events = ray_run.metrics, ray_run.events
    assert not cluster.exists()
    [died] = [e for e in events if e.name == "rollout_worker_died"]
    assert died.fields["worker"] == 1 and died.fields["groups_requeued"] >= 1
    assert died.fields["error"] in ("ActorDiedError", "RayActorError")
    alive = _values(metrics, "rollout/workers_alive")
    assert alive[0] in (1.0, 2.0) and alive[-1] == 1.0
    assert sum(_values(metrics, "rollout/leases_requeued")) == died.fields["groups_requeued"]
    _assert_same_run(ray_run, local_run, losses=False)  # the re-run groups: the same numbers


@pytest.fixture(scope="module")
def ppo_local_run(prompts_inputs, tmp_path_factory):
    from rollout.algorithms.ppo import train_ppo

    cfg = load_config(_config(tmp_path_factory.mktemp("ppo-local"), prompts_inputs, '[distributed]\nkind = "local"\n',
                              kind="ppo"))
    return _final(cfg, train_ppo(cfg).run_id)


def test_ray_ppo_weights_match_local(cluster, ppo_local_run, prompts_inputs, tmp_path):
    """PPO (policy and value model in the learner) with 2 rollout workers: the same weights as one
    batch-invariant process."""
    from rollout.algorithms.ppo import train_ppo

    local_run = ppo_local_run
    cfg = load_config(_config(tmp_path / "ray", prompts_inputs, RAY, kind="ppo"))
    ray_run = _final(cfg, train_ppo(cfg).run_id)
    metrics, events = ray_run.metrics, ray_run.events
    _assert_same_run(ray_run, local_run)
    assert min(abs(v) for v in _values(local_run.metrics, "train/grad_norm")) > 0
    groups = [sum(_values(metrics, f"rollout/worker/{w}/groups")) for w in (0, 1)]
    assert sum(groups) == 3 * N and min(groups) >= 1
    assert [e.fields["workers"] for e in events if e.name == "rollout_workers_started"] == [2]


# --------------------------------------------------------------------------- learner actors


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_two_learner_actors_train_as_one_process(kind, cluster, local_run, ppo_local_run, prompts_inputs, tmp_path):
    """`num_learners = 2`: two learner actors (GRPO: FSDP2, PPO: DDP, over gloo), learner 0's rollout
    worker makes every round: the local run's rewards, and its losses and weights up to float
    reassociation (the gradients are summed over the learners), as torchrun's ranks."""
    from rollout.cli.train import run_training

    sharding = "fsdp" if kind == "grpo" else "ddp"
    learners = RAY.replace("num_rollout_workers = 2", "num_rollout_workers = 1") + (
        f'num_learners = 2\nsharding = "{sharding}"\n')
    cfg = load_config(_config(tmp_path, prompts_inputs, learners, kind=kind))
    local_run = local_run if kind == "grpo" else ppo_local_run
    result = run_training(cfg, None)  # what `rollout train <kind>` runs after its plan
    run = _final(cfg, result.run_id)
    assert _values(run.metrics, "rollout/reward_mean") == _values(local_run.metrics, "rollout/reward_mean")
    losses = {m.step: m.value for m in run.metrics if m.name == "train/loss"}
    local_losses = {m.step: m.value for m in local_run.metrics if m.name == "train/loss"}
    assert_close_runs(local_losses, losses, local_run.weights, run.weights, loss_atol=1e-6)
    assert [e.fields for e in run.events if e.name == "process_group"] == [{"world_size": 2, "sharding": sharding}]
    assert sum(_values(run.metrics, "rollout/worker/0/groups")) == 3 * N  # learner 0's worker made every group
    assert [e.fields["workers"] for e in run.events if e.name == "rollout_workers_started"] == [1]
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        assert [r.id for r in store.list_runs()] == [result.run_id]  # learner 0 alone wrote
        row = store.get_run(result.run_id)
        assert row.status == "succeeded"
        assert row.config_digest == cfg.digest()  # the learners validated the driver's config again, unchanged
    finally:
        store.close()
    _assert_all_cpus_free()  # the learner and worker actors ended with the run


def test_a_failing_learner_ends_the_group_promptly(cluster, prompts_inputs, tmp_path):
    """Learner 0 refuses a resume id it can't find while learner 1 waits on it in a collective: the
    driver kills learner 1 at once (not after the collective timeout) and raises learner 0's own
    error, which the CLI prints as one line (exit 2)."""
    from rollout.cli.train import run_training
    from rollout.errors import SnapshotNotFound

    cfg = load_config(_config(tmp_path, prompts_inputs, RAY + "num_learners = 2\ntimeout_s = 600\n"))
    started = time.monotonic()
    with pytest.raises(SnapshotNotFound, match="0123456789abcdef"):
        run_training(cfg, "0123456789abcdef")
    assert time.monotonic() - started < 60
    _assert_all_cpus_free()  # both learner actors are gone


def test_a_dead_learner_ends_the_run_as_failed(cluster, prompts_inputs, tmp_path):
    """Learner 1's process is killed mid-run (`ray.kill`): the run ends as failed, promptly (not after
    the collective timeout), with a DistributedError: the driver's, naming learner 1, or learner
    0's own when its collective with the dead learner failed first."""
    import threading

    from rollout.cli.train import run_training
    from rollout.errors import DistributedError

    cfg = load_config(_config(tmp_path, prompts_inputs, RAY.replace("num_rollout_workers = 2", "num_rollout_workers = 1")
                              + "num_learners = 2\n", {"max_steps = 250": "max_steps = 200"}))

    def kill_learner_1_once_training() -> None:
        db = Path(cfg.storage.embedded.path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if db.exists():
                store = open_store("embedded", path=db)
                try:
                    runs = store.list_runs()
                    steps = store.read_metrics(runs[0].id, name="train/loss") if runs else []
                finally:
                    store.close()
                if steps:  # the group trains
                    [name] = [n for n in ray.util.list_named_actors() if n.startswith("rollout-learners-")
                              and n.endswith("-1")]
                    ray.kill(ray.get_actor(name))
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_learner_1_once_training, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"learner 1 failed: \w+|rank 0: a collective"):
        run_training(cfg, None)
    assert time.monotonic() - started < 150
    killer.join(timeout=5)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        [run] = store.list_runs()
        assert run.status == "failed" and run.error, (run.status, run.error)
        assert len(store.read_metrics(run.id, name="train/loss")) < 200  # it stopped, long before the budget
    finally:
        store.close()
    _assert_all_cpus_free()


def _assert_all_cpus_free(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 4, ray.available_resources()


# --------------------------------------------------------------------------- plan-time errors


def _plan(path: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src")])}
    return subprocess.run([sys.executable, "-m", "rollout.cli.main", "train", "grpo", "--config", str(path),
                           "--dry-run"], capture_output=True, text=True, env=env)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('kind = "ray"\nnum_rollout_workers = 0\n', "distributed.num_rollout_workers"),
        ('kind = "ray"\n', "distributed.num_rollout_workers: missing field"),
        ('kind = "ray"\nnum_rollout_workers = 2\nworkers = 2\n', "distributed.workers: unknown field"),
        ('kind = "ray"\nnum_rollout_workers = 2\naddress = "10.0.0.1:6379"\n', "distributed.address"),
    ],
)
def test_bad_ray_block_is_a_located_error(block, message, prompts_inputs, tmp_path):
    path = _config(tmp_path, prompts_inputs, f"[distributed]\n{block}")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    out = _plan(path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_ray_block_defaults_and_plan_checks(prompts_inputs, tmp_path):
    from rollout.cli.config_cmds import check_runtime
    from rollout.distributed import check_ray

    path = _config(tmp_path, prompts_inputs, RAY)
    cfg = load_config(path)
    assert cfg.distributed == RayDistributedConfig(kind="ray", num_rollout_workers=2)
    assert (cfg.distributed.address, cfg.distributed.num_cpus_per_worker, cfg.distributed.lease_timeout_s) == (
        "local", 1.0, 600.0)
    check_runtime(cfg, source=path)  # grpo runs under ray
    with pytest.raises(ConfigError, match=r'run.toml:\d+: distributed.kind: "ray" needs Ray, which is not installed'):
        check_ray(cfg, source=path, find_spec=lambda name: None)
    ppo = _config(tmp_path / "ppo", prompts_inputs, RAY, kind="ppo")
    check_runtime(load_config(ppo), source=ppo)  # and ppo
    sft = parse_config((ROOT / "examples" / "sft-tiny.toml").read_text().replace(
        '[distributed]\nkind = "local"\n', RAY), source=ROOT / "examples" / "sft-tiny.toml")
    with pytest.raises(ConfigError, match='distributed.kind: "ray" is not implemented for sft'):
        check_runtime(sft, source=ROOT / "examples" / "sft-tiny.toml")


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("ppo", {}, r'distributed.sharding: ppo runs under sharding = "ddp"'),
        ("grpo", {"off_policy_steps = 0": "off_policy_steps = 1"},
         r"algorithm.grpo.off_policy_steps: generating the next batch while training"),
        ("grpo", {"off_policy_steps = 0": "off_policy_steps = 0\nlora = { r = 4 }"},
         r'distributed.sharding: LoRA runs under sharding = "ddp" only'),
    ],
)
def test_learner_group_plan_checks(kind, extra, message, prompts_inputs, tmp_path):
    from rollout.cli.config_cmds import check_runtime

    path = _config(tmp_path, prompts_inputs, RAY + "num_learners = 2\n", extra, kind=kind)
    cfg = load_config(path)
    assert (cfg.distributed.num_learners, cfg.distributed.sharding, cfg.distributed.timeout_s) == (2, "fsdp", 1800.0)
    with pytest.raises(ConfigError, match=r"run.toml:\d+: " + message):
        check_runtime(cfg, source=path)


def test_worker_engines_get_the_runs_engine_settings(prompts_inputs, tmp_path):
    """A rollout worker builds its engine as the in-process one is built: `[inference] kept_cache_mb`
    caps the KV caches kept between an episode's turns, `max_batch_size` its batch (no Ray needed:
    the worker class runs here as it does inside an actor)."""
    from rollout.inference.kept_cache import DEFAULT_KEPT_CACHE_BYTES
    from rollout.models.load import ModelSource
    from rollout.rl.manager import GroupSpec
    from rollout.rl.ray_rollout import RolloutWorker, worker_spec

    def spec_of(path: Path):
        cfg = load_config(path)
        s = cfg.algorithm.settings
        group = GroupSpec(s.num_generations, None, cfg.seed, s.reward_timeout_s)
        return worker_spec(cfg, ModelSource(**s.base_model.model_dump()), group=group, rewards=s.rewards, env=s.env)

    default = spec_of(_config(tmp_path / "default", prompts_inputs, RAY))
    assert (default.kept_cache_bytes, default.max_batch_size, default.num_threads) == (DEFAULT_KEPT_CACHE_BYTES, 256, 1)
    spec = spec_of(_config(tmp_path / "set", prompts_inputs, RAY + "\n[inference]\nkept_cache_mb = 3\nmax_batch_size = 24\n"))
    assert (spec.kept_cache_bytes, spec.max_batch_size, spec.device) == (3 << 20, 24, "cpu")
    worker = RolloutWorker(0, spec)
    try:
        assert worker.engine._kept.max_bytes == 3 << 20
    finally:
        worker.engine.close()
