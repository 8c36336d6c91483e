"""Helpers for the torchrun tests: run configs, the CLI in a fresh process (test modules import
them directly: `from dist_helpers import write_config`; the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Inputs:
    model: Path
    sft: Path
    pref: Path


def distributed_block(world: int | None, sharding: str = "fsdp") -> str:
    """`[distributed]`: local for None, else torchrun with `world` ranks on this host."""
    if world is None:
        return '[distributed]\nkind = "local"\n'
    return f'[distributed]\nkind = "torchrun"\nnproc_per_node = {world}\nsharding = "{sharding}"\n'


def write_config(
    dest: Path, kind: str, inputs: Inputs, *, distributed: str, max_steps: int, every_steps: int,
    store: Path | None = None, extra: str = "",
) -> Path:
    """A tiny SFT (bfd packing), DPO, KTO or RM run: micro-batches of 4, 2 per step, a snapshot every
    `every_steps`; its store in `store` (default: `dest`); `extra` TOML appended to the algorithm's
    block (e.g. `[algorithm.sft.export]`)."""
    store = store or dest
    dest.mkdir(parents=True, exist_ok=True)
    if kind == "sft":
        algorithm = f"""
[algorithm]
kind = "sft"
[algorithm.sft]
minibatch_size = 4
gradient_accumulation = 2
[algorithm.sft.base_model]
uri = "{inputs.model}"
[algorithm.sft.optimizer]
kind = "adamw"
lr = 3e-3
[algorithm.sft.scheduler]
kind = "cosine"
warmup_steps = 1
[algorithm.sft.budget]
max_steps = {max_steps}
[algorithm.sft.dataset]
kind = "jsonl_path"
path = "{inputs.sft}"
[algorithm.sft.packing]
kind = "bfd"
max_seq_len = 64
[algorithm.sft.loss_on]
kind = "assistant"
[algorithm.sft.snapshot]
every_steps = {every_steps}
"""
    else:  # dpo, rm: the same pairs; kto: the same lines, labelled
        own = "beta = 0.1" if kind in ("dpo", "kto") else 'head = "bradley_terry"\n[algorithm.rm.loss_on]\nkind = "full"'
        algorithm = f"""
[algorithm]
kind = "{kind}"
[algorithm.{kind}]
minibatch_size = 4
gradient_accumulation = 2
{own}
[algorithm.{kind}.base_model]
uri = "{inputs.model}"
[algorithm.{kind}.optimizer]
kind = "adamw"
lr = 5e-4  # the examples'; Adam turns float noise in near-zero gradients into ~lr-sized differences
[algorithm.{kind}.scheduler]
kind = "constant"
[algorithm.{kind}.budget]
max_steps = {max_steps}
[algorithm.{kind}.dataset]
kind = "jsonl_path"
path = "{inputs.sft.parent / "kto.jsonl" if kind == "kto" else inputs.pref}"
[algorithm.{kind}.packing]
kind = "off"
max_seq_len = 64
[algorithm.{kind}.snapshot]
every_steps = {every_steps}
"""
    text = f"""schema_version = 1
seed = 0
[storage]
backend = "embedded"
[storage.embedded]
path = "{store}/rollout.db"
[storage.objects]
backend = "fs"
path = "{store}/objects"
{algorithm}{extra}
{distributed}"""
    path = dest / f"{kind}.toml"
    path.write_text(text)
    return path


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):  # a launcher's, not ours
        env.pop(name, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def train_cli(kind: str, config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`rollout train KIND --config CONFIG ARGS...` in a fresh process (which launches torchrun)."""
    return subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", "train", kind, "--config", str(config), *args],
        env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )


def planned_run_cli(config: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`rollout plan --config CONFIG -o LOCK`, then `rollout run --plan LOCK` (which launches torchrun)."""
    lock = config.parent / "plan.lock"
    command = [sys.executable, "-m", "rollout.cli.main"]
    plan = subprocess.run([*command, "plan", "--config", str(config), "-o", str(lock)],
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert plan.returncode == 0, plan.stderr[-4000:]
    return subprocess.run([*command, "run", "--plan", str(lock)], env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_id_of(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, out.stderr[-4000:]
    return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("run "))


def assert_close_runs(
    losses_a: dict[int, float], losses_b: dict[int, float], weights_a: dict, weights_b: dict, *, atol: float = 1e-5,
    loss_atol: float = 0.0,
) -> None:
    """Two runs' per-step losses (relative 1e-5, plus `loss_atol`) and final weights agree: the same
    steps up to float reassociation (gradients summed over ranks)."""
    import pytest
    import torch

    assert sorted(losses_a) == sorted(losses_b)
    for step in losses_a:
        assert losses_b[step] == pytest.approx(losses_a[step], rel=1e-5, abs=loss_atol), f"step {step}"
    assert weights_a.keys() == weights_b.keys()
    outside = 0
    for name in weights_a:
        assert weights_a[name].shape == weights_b[name].shape, name
        # every element within 5 x atol, and all but about one in 10,000 within 1e-5: on some CPUs a
        # lone element lands at ~2e-5 after 4 steps (1.9e-5 seen, o_proj) while the losses agree to 1e-7
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=0, atol=5 * atol, msg=name)
        outside += int(((weights_b[name] - weights_a[name]).abs() > 1e-5).sum())
    assert outside <= sum(w.numel() for w in weights_a.values()) // 10_000  # 1e-5 for all but a few
