"""The DPO/KTO reference policy: one model under LoRA, a reusable precomputed table."""

from __future__ import annotations

import math

from integration_helpers import example_config

from rollout.config import load_config
from rollout.store import open_store

SMALL = {
    '"../local/models/sft-tiny"': '"../local/models/tiny"',
    "minibatch_size = 16": "minibatch_size = 4",
    "max_steps = 300": "max_steps = 2",
    "every_steps = 150": "every_steps = 100",
}


def _events(cfg, run_id):
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        return [(e.name, e.fields) for e in store.read_events(run_id)]
    finally:
        store.close()


def _first_loss(cfg, run_id):
    store = open_store("embedded", path=cfg.storage.embedded.path)
    try:
        return next(m.value for m in store.read_metrics(run_id, name="train/loss") if m.step == 1)
    finally:
        store.close()


def test_lora_reference_is_the_policy_itself(workspace):
    """Under LoRA the reference is the adapter-disabled policy: no second model in memory."""
    from rollout.algorithms.config import LoraConfig
    from rollout.algorithms.reference import build_reference
    from rollout.models.load import ModelSource, apply_lora, load_model

    base = ModelSource(uri=str(workspace / "models" / "tiny"))
    policy = apply_lora(load_model(base, task="causal_lm", pad_token_id=0, seed=0), task="causal_lm",
                        **LoraConfig().model_dump())
    ref = build_reference(
        None, policy, base=base, reference_uri=None, precompute=False, lora=True, pad_token_id=0, device="cpu",
        seed=0, precompute_fn=lambda r: None, data_digest="",
    )
    assert ref.kind == "adapter" and ref.model is policy
    held = {id(p): p.numel() for m in (policy, ref.model) for p in m.parameters()}
    assert sum(held.values()) == sum(p.numel() for p in policy.parameters())


def test_lora_dpo_step0_loss_equals_full_reference_dpo(workspace, tmp_path):
    from rollout.algorithms.dpo import train_dpo

    lora = {**SMALL, "[algorithm.dpo.reference]": "[algorithm.dpo.lora]\nr = 4\n[algorithm.dpo.reference]"}
    losses = []
    for name, replace in (("full", SMALL), ("lora", lora)):
        cfg = load_config(example_config("dpo-tiny.toml", workspace, tmp_path / name, replace))
        result = train_dpo(cfg)
        kinds = [f["reference"] for n, f in _events(cfg, result.run_id) if n == "train_start"]
        assert kinds == (["copy"] if name == "full" else ["adapter"])
        losses.append(_first_loss(cfg, result.run_id))
    # at step 0 the policy equals the reference either way: the DPO loss is exactly log 2
    assert abs(losses[0] - losses[1]) < 1e-6
    assert abs(losses[0] - math.log(2.0)) < 1e-6


def test_precomputed_reference_is_reused_by_the_next_run(workspace, tmp_path):
    from rollout.algorithms.dpo import train_dpo

    cfg = load_config(example_config("dpo-tiny.toml", workspace, tmp_path, {**SMALL, "precompute = false": "precompute = true"}))
    first = train_dpo(cfg)
    second = train_dpo(cfg)
    names1 = [n for n, _ in _events(cfg, first.run_id)]
    ev2 = _events(cfg, second.run_id)
    assert "reference_precomputed" in names1 and "reference_reused" not in names1
    reused = [f for n, f in ev2 if n == "reference_reused"]
    assert reused and reused[0]["reason"] == "same model and data"
    assert "reference_precomputed" not in [n for n, _ in ev2]
    # identical inputs + identical reference values => identical training
    assert _first_loss(cfg, first.run_id) == _first_loss(cfg, second.run_id)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    tables = [s for s in store.list_snapshots(kind="buffer") if (s.label or "").startswith("reference_logps:")]
    store.close()
    assert len(tables) == 1 and tables[0].manifest["blobs"]["logps"]["tensors"]["logps"]["shape"] == [2 * 4000]
