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
from ray_plugins import KILL_FLAG_ENV

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


def _final(cfg, run_id) -> Final:
    """The final snapshot's model digest (its blob read back, verified), the run's metrics and events."""
    store = open_store("embedded", path=cfg.storage.embedded.path)
    objects = open_object_store("fs", path=cfg.storage.objects.path)
    try:
        [snap] = [s for s in store.list_snapshots(run_id=run_id, kind="train_state") if s.step == N]
        read_snapshot_blob(objects, snap, "model")  # the blob is there and matches its digest
        return Final(snap.manifest["blobs"]["model"]["digest"], store.read_metrics(run_id), store.read_events(run_id))
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


def test_ray_ppo_weights_match_local(cluster, prompts_inputs, tmp_path):
    """PPO (policy and value model in the learner) with 2 rollout workers: the same weights as one
    batch-invariant process."""
    from rollout.algorithms.ppo import train_ppo

    local = load_config(_config(tmp_path / "local", prompts_inputs, '[distributed]\nkind = "local"\n', kind="ppo"))
    local_run = _final(local, train_ppo(local).run_id)
    cfg = load_config(_config(tmp_path / "ray", prompts_inputs, RAY, kind="ppo"))
    ray_run = _final(cfg, train_ppo(cfg).run_id)
    metrics, events = ray_run.metrics, ray_run.events
    _assert_same_run(ray_run, local_run)
    assert min(abs(v) for v in _values(local_run.metrics, "train/grad_norm")) > 0
    groups = [sum(_values(metrics, f"rollout/worker/{w}/groups")) for w in (0, 1)]
    assert sum(groups) == 3 * N and min(groups) >= 1
    assert [e.fields["workers"] for e in events if e.name == "rollout_workers_started"] == [2]


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
