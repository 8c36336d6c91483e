"""Resume is bit-identical: N steps straight vs N/2 steps + --resume + N/2 steps.

Run A trains N steps and snapshots at N/2 and N. Run B is a separate process
(the real CLI) resuming from A's N/2 snapshot by id prefix. The model and
optimizer blobs at step N must have the same digests (byte-identical
safetensors) and the per-step losses after the resume point must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from integration_helpers import example_config

from rollout.config import load_config
from rollout.store import open_store

N = 8


def _snapshots(db, run_id):
    store = open_store("embedded", path=db)
    try:
        return {s.step: s for s in store.list_snapshots(run_id=run_id, kind="train_state")}, {
            m.step: m.value for m in store.read_metrics(run_id, name="train/loss")
        }
    finally:
        store.close()


def _resume_cli(config, snapshot_id):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", "train", _kind(config), "--config", str(config),
         "--resume", snapshot_id[:12]],
        capture_output=True, text=True, env=env,
    )
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split("run ", 1)[1].split()[0]
    return run_id


def _kind(config):
    return config.name.split("-")[0]


def _trainer(kind):
    import importlib

    return getattr(importlib.import_module(f"rollout.algorithms.{kind}"), f"train_{kind}")


_PREF = {
    '"../local/models/sft-tiny"': '"../local/models/tiny"',
    "minibatch_size = 16": "minibatch_size = 4",
    "gradient_accumulation = 1": "gradient_accumulation = 2",
    "keep_last = 3": "keep_last = 10",
}
_DPO = {**_PREF, "max_steps = 300": f"max_steps = {N}", "every_steps = 150": f"every_steps = {N // 2}"}
_KTO = {**_PREF, "max_steps = 150": f"max_steps = {N}", "every_steps = 75": f"every_steps = {N // 2}"}


CASES = {
    "sft-bfd-accum": ("sft-tiny.toml", {
        "minibatch_size = 32": "minibatch_size = 4",
        "gradient_accumulation = 1": "gradient_accumulation = 2",
        'kind = "off"': 'kind = "bfd"',
        "max_steps = 400": f"max_steps = {N}",
        "every_steps = 200": f"every_steps = {N // 2}",
        "keep_last = 3": "keep_last = 10",
        "warmup_steps = 20": "warmup_steps = 2",
    }),
    "sft-wrapped": ("sft-tiny.toml", {
        "minibatch_size = 32": "minibatch_size = 2",
        'kind = "off"': 'kind = "wrapped"',
        "max_steps = 400": f"max_steps = {N}",
        "every_steps = 200": f"every_steps = {N // 2}",
        "keep_last = 3": "keep_last = 10",
    }),
    "rm-accum": ("rm-tiny.toml", {
        '"../local/models/sft-tiny"': '"../local/models/tiny"',
        "minibatch_size = 64": "minibatch_size = 4",
        "gradient_accumulation = 1": "gradient_accumulation = 2",
        "max_steps = 800": f"max_steps = {N}",
        "every_steps = 400": f"every_steps = {N // 2}",
        "keep_last = 3": "keep_last = 10",
        "warmup_steps = 20": "warmup_steps = 2",
    }),
    "dpo-frozen-ref": ("dpo-tiny.toml", _DPO),
    "dpo-precomputed-ref": ("dpo-tiny.toml", {**_DPO, "precompute = false": "precompute = true"}),
    "kto": ("kto-tiny.toml", _KTO),
}
_ONEDNN = {'[distributed]\nkind = "local"': '[backend]\ncpu_matmul = "onednn"\n\n[distributed]\nkind = "local"'}
_BIG = {"max_steps = 300": f"max_steps = {N}", "every_steps = 150": f"every_steps = {N // 2}",  # 16 pairs a step:
        "keep_last = 3": "keep_last = 10", '"../local/models/sft-tiny"': '"../local/models/tiny"'}  # products of >= 128 rows
CASES["sft-bfd-onednn"] = ("sft-tiny.toml", {**CASES["sft-bfd-accum"][1], "minibatch_size = 32": "minibatch_size = 8",
                                             "gradient_accumulation = 1": "gradient_accumulation = 1",  # undo -accum's 2
                                             **_ONEDNN})
CASES["dpo-frozen-ref-onednn"] = ("dpo-tiny.toml", {**_BIG, **_ONEDNN})  # the reference and the gathered head too


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_identical(case, workspace, tmp_path, monkeypatch):
    from rollout.models import cpu_matmul

    name, replace = CASES[case]
    config = example_config(name, workspace, tmp_path, replace)
    cfg = load_config(config)
    calls = []
    apply = cpu_matmul._OneDNNLinear.apply
    monkeypatch.setattr(cpu_matmul._OneDNNLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    full = _trainer(cfg.algorithm.kind)(cfg)
    assert bool(calls) == case.endswith("-onednn")  # `[backend] cpu_matmul` decides the products' library
    snaps_a, losses_a = _snapshots(cfg.storage.embedded.path, full.run_id)
    assert sorted(snaps_a) == [N // 2, N]

    run_b = _resume_cli(config, snaps_a[N // 2].id)
    snaps_b, losses_b = _snapshots(cfg.storage.embedded.path, run_b)
    assert sorted(snaps_b) == [N]

    a, b = snaps_a[N].manifest["blobs"], snaps_b[N].manifest["blobs"]
    assert a["model"]["digest"] == b["model"]["digest"], "weights differ after resume"
    assert a["optimizer"]["digest"] == b["optimizer"]["digest"], "optimizer state differs after resume"
    assert [losses_a[s] for s in range(N // 2 + 1, N + 1)] == [losses_b[s] for s in range(N // 2 + 1, N + 1)]
    # the resumed run records where it came from
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        assert store.get_run(run_b).resumed_from == snaps_a[N // 2].id
        assert snaps_b[N].parent_id == snaps_a[N // 2].id
    finally:
        store.close()
    # and training really changed the weights in between
    assert snaps_a[N // 2].manifest["blobs"]["model"]["digest"] != a["model"]["digest"]
    state = json.loads(json.dumps(snaps_b[N].manifest["extra"]))
    assert state["algorithm"] == cfg.algorithm.kind


def test_same_seed_same_numbers_different_seed_differs(workspace, tmp_path):
    from rollout.algorithms.sft import train_sft

    replace = dict(CASES["sft-wrapped"][1])
    runs = []
    for i, seed in enumerate((0, 0, 1)):
        config = example_config("sft-tiny.toml", workspace, tmp_path / f"r{i}", {**replace, "seed = 0": f"seed = {seed}"})
        cfg = load_config(config)
        result = train_sft(cfg)
        snaps, _ = _snapshots(cfg.storage.embedded.path, result.run_id)
        runs.append(snaps[N].manifest["blobs"]["model"]["digest"])
    assert runs[0] == runs[1] != runs[2]
