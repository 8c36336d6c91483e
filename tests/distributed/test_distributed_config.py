"""`[distributed]` config, plan-time checks, the torchrun command, the batch split and the launcher's
bookkeeping, without starting ranks (those are in test_torchrun.py).

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/distributed/test_distributed_config.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import cli_env, distributed_block, write_config

from rollout.config import LocalDistributedConfig, TorchrunDistributedConfig, load_config, parse_config
from rollout.distributed import LOCAL, Distributed, join_process_group
from rollout.errors import ConfigError, DistributedError
from rollout.launch import end_orphaned_run, torchrun_command
from rollout.store import open_store

ROOT = Path(__file__).resolve().parents[2]


def _example(replace_distributed: str) -> str:
    text = (ROOT / "examples" / "sft-tiny.toml").read_text()
    return text.replace('[distributed]\nkind = "local"\n', replace_distributed)


def _parse(text: str):
    return parse_config(text, source=ROOT / "examples" / "sft-tiny.toml")


def test_torchrun_block_parses_with_defaults():
    cfg = _parse(_example('[distributed]\nkind = "torchrun"\nnproc_per_node = 2\n'))
    assert cfg.distributed == TorchrunDistributedConfig(kind="torchrun", nproc_per_node=2)
    assert (cfg.distributed.nnodes, cfg.distributed.sharding, cfg.distributed.rdzv_endpoint) == (1, "fsdp", None)


def test_local_is_the_default_and_keeps_its_digest():
    explicit = _parse(_example('[distributed]\nkind = "local"\n'))
    no_kind = _parse(_example("[distributed]\n"))
    no_block = _parse(_example(""))
    assert explicit.distributed == no_kind.distributed == no_block.distributed == LocalDistributedConfig()
    assert explicit.digest() == no_kind.digest() == no_block.digest()
    assert '"distributed":{"kind":"local"}' in explicit.canonical_json()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('kind = "torchrun"\n', "distributed.nproc_per_node: missing field"),
        ('kind = "torchrun"\nnproc_per_node = 0\n', "distributed.nproc_per_node"),
        ('kind = "torchrun"\nnproc_per_node = 2\nnnodes = 2\n', "nnodes > 1 needs rdzv_endpoint"),
        ('kind = "torchrun"\nnproc_per_node = 2\nrdzv_endpoint = "host; rm -rf /"\n', "distributed.rdzv_endpoint"),
        ('kind = "torchrun"\nnproc_per_node = 2\nsharding = "zero3"\n', "distributed.sharding"),
        ('kind = "local"\nnproc_per_node = 2\n', "distributed.nproc_per_node: unknown field"),
        ('kind = "slurm"\n', "distributed"),
    ],
)
def test_bad_distributed_blocks_are_located(block, message):
    with pytest.raises(ConfigError) as err:
        _parse(_example(f"[distributed]\n{block}"))
    assert message in str(err.value)
    assert "sft-tiny.toml:" in str(err.value)


def test_torchrun_command_single_and_multi_host():
    one = TorchrunDistributedConfig(kind="torchrun", nproc_per_node=2)
    cmd = torchrun_command(one, ["train", "sft", "--config", "/x/run.toml"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nproc-per-node", "2", "--standalone", "-m", "rollout.cli.main",
                       "train", "sft", "--config", "/x/run.toml"]
    many = TorchrunDistributedConfig(kind="torchrun", nproc_per_node=4, nnodes=2, rdzv_endpoint="10.0.0.1:29500")
    cmd = torchrun_command(many, ["train", "dpo"])
    assert cmd[3:11] == ["--nproc-per-node", "4", "--nnodes", "2", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "10.0.0.1:29500"]
    assert "--standalone" not in cmd


def test_each_rank_takes_its_contiguous_slice():
    rows = list(range(8))
    assert LOCAL.shard(rows) == rows
    assert Distributed(rank=0, world_size=2, sharding="fsdp").shard(rows) == [0, 1, 2, 3]
    assert Distributed(rank=1, world_size=2, sharding="fsdp").shard(rows) == [4, 5, 6, 7]
    assert Distributed(rank=3, world_size=4, sharding="ddp").shard(rows) == [6, 7]
    with pytest.raises(DistributedError, match="does not split over 3 ranks"):
        Distributed(rank=0, world_size=3, sharding="fsdp").shard(rows)
    assert LOCAL.sum([1, 2.5]) == [1.0, 2.5] and LOCAL.broadcast_text("abc") == "abc"


def test_launcher_environment_and_kind_must_agree(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    torchrun = TorchrunDistributedConfig(kind="torchrun", nproc_per_node=2)
    with pytest.raises(ConfigError, match="start it with `rollout train`"):
        join_process_group(torchrun, device="cpu")
    assert join_process_group(LocalDistributedConfig(), device="cpu") is LOCAL
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match='WORLD_SIZE=2 but \\[distributed\\] kind = "local"'):
        join_process_group(LocalDistributedConfig(), device="cpu")


def _validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", "validate", "--config", str(config)],
        env=cli_env(), capture_output=True, text=True, timeout=120,
    )


def test_validate_refuses_what_torchrun_cannot_run(inputs, tmp_path):
    ok = write_config(tmp_path / "ok", "sft", inputs, distributed=distributed_block(2), max_steps=2, every_steps=2)
    out = _validate(ok)
    assert out.returncode == 0, out.stderr

    uneven = write_config(tmp_path / "uneven", "sft", inputs, distributed=distributed_block(3), max_steps=2,
                          every_steps=2)
    out = _validate(uneven)
    assert out.returncode == 2
    assert "algorithm.sft.minibatch_size: 4 rows do not split over 3 ranks" in out.stderr
    assert "Traceback" not in out.stderr

    lora = write_config(tmp_path / "lora", "sft", inputs, distributed=distributed_block(2), max_steps=2, every_steps=2)
    lora.write_text(lora.read_text().replace("[algorithm.sft.optimizer]", "[algorithm.sft.lora]\nr = 4\n"
                                             "[algorithm.sft.optimizer]"))
    out = _validate(lora)
    assert out.returncode == 2
    assert 'distributed.sharding: LoRA runs under sharding = "ddp" only' in out.stderr
    lora.write_text(lora.read_text().replace('sharding = "fsdp"', 'sharding = "ddp"'))
    assert _validate(lora).returncode == 0

    torchrun = '[distributed]\nkind = "torchrun"\nnproc_per_node = 2'
    ppo = (ROOT / "examples" / "ppo-tiny.toml").read_text().replace('[distributed]\nkind = "local"', torchrun)
    (tmp_path / "ppo.toml").write_text(ppo.replace('"../local/', f'"{ROOT}/local/'))
    out = _validate(tmp_path / "ppo.toml")
    assert out.returncode == 2
    assert 'distributed.sharding: ppo runs under sharding = "ddp"' in out.stderr  # FSDP2, the default: not for ppo
    (tmp_path / "ppo.toml").write_text(ppo.replace('"../local/', f'"{ROOT}/local/').replace(
        torchrun, torchrun + '\nsharding = "ddp"'))
    from rollout.cli.config_cmds import check_runtime

    check_runtime(load_config(tmp_path / "ppo.toml"), source=tmp_path / "ppo.toml")  # ddp: ppo runs

    grpo = (ROOT / "examples" / "grpo-tiny.toml").read_text().replace('[distributed]\nkind = "local"', torchrun)
    grpo = grpo.replace('"../local/', f'"{ROOT}/local/')
    for old, new, message in [
        ("off_policy_steps = 0", "off_policy_steps = 1",
         "algorithm.grpo.off_policy_steps: generating the next batch while training is not implemented"),
        ("minibatch_size = 16", "minibatch_size = 15", "algorithm.grpo.minibatch_size: 15 prompts do not split over 2"),
        ("[distributed]", '[inference]\nengine = "openai"\nbase_url = "http://127.0.0.1:1/v1"\n[distributed]',
         'inference.engine: torchrun ranks sample with the hf engine, not "openai"'),
    ]:
        assert old in grpo, old
        (tmp_path / "grpo.toml").write_text(grpo.replace(old, new))
        out = _validate(tmp_path / "grpo.toml")
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr


def test_launcher_marks_a_run_its_ranks_left_running(inputs, tmp_path):
    config = write_config(tmp_path, "sft", inputs, distributed=distributed_block(2), max_steps=2, every_steps=2)
    cfg = load_config(config)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        left = store.create_run(algorithm="sft", config_digest=cfg.digest(), config_json=cfg.canonical_json(),
                                name=None, resumed_from=None)
        store.set_run_status(left.id, "running")
        done = store.create_run(algorithm="sft", config_digest=cfg.digest(), config_json=cfg.canonical_json(),
                                name=None, resumed_from=None)
        store.set_run_status(done.id, "failed", error="rank 0: the real cause")
    finally:
        store.close()
    id_file = tmp_path / "run-id"
    assert end_orphaned_run(cfg, id_file, "failed", "x") is None  # rank 0 never announced a run
    for run_id in (left.id, done.id):
        id_file.write_text(run_id)
        assert end_orphaned_run(cfg, id_file, "failed", "a torchrun rank failed") == run_id
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        assert (store.get_run(left.id).status, store.get_run(left.id).error) == ("failed", "a torchrun rank failed")
        assert store.get_run(done.id).error == "rank 0: the real cause"  # rank 0's own word is kept
    finally:
        store.close()


def test_a_torchrun_config_started_in_process_fails_before_any_run(inputs, tmp_path, monkeypatch):
    from rollout.algorithms.sft import train_sft

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(write_config(tmp_path, "sft", inputs, distributed=distributed_block(2), max_steps=2,
                                   every_steps=2))
    with pytest.raises(ConfigError, match="torchrun"):
        train_sft(cfg)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        assert store.list_runs() == []
    finally:
        store.close()


@pytest.mark.parametrize(
    ("kind", "distributed", "message"),
    [
        ("sft", None, 'backend.kind: "fsdp" shards the model over a process group: set [distributed] kind = "torchrun"'),
        ("sft", "ddp", 'distributed.sharding: "ddp" contradicts [backend] kind = "fsdp"'),
        ("sft", "fsdp", None),
        ("dpo", "fsdp", None),
    ],
)
def test_fsdp_backend_needs_ranks_and_fsdp_sharding(kind, distributed, message, inputs, tmp_path):
    """`[backend] kind = "fsdp"` (SPEC 7's name for FSDP2): over torchrun's ranks, not in one process,
    and not beside `sharding = "ddp"`."""
    block = distributed_block(2, distributed) if distributed else distributed_block(None)
    path = write_config(tmp_path, kind, inputs, distributed=block, max_steps=2, every_steps=2)
    path.write_text(path.read_text() + '\n[backend]\nkind = "fsdp"\n')
    out = _validate(path)
    if message is None:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_fsdp_backend_is_not_ppos(tmp_path):
    ppo = (ROOT / "examples" / "ppo-tiny.toml").read_text().replace(
        '[distributed]\nkind = "local"', '[backend]\nkind = "fsdp"\n[distributed]\nkind = "torchrun"\nnproc_per_node = 2')
    (tmp_path / "ppo.toml").write_text(ppo.replace('"../local/', f'"{ROOT}/local/'))
    out = _validate(tmp_path / "ppo.toml")
    assert out.returncode == 2 and 'backend.kind: "fsdp" is not implemented for ppo (use "torch")' in out.stderr
