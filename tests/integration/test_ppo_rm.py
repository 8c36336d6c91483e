"""Reward models as RL rewards (`kind = "reward_model"`): the entry, exact scoring, normalisation,
weights, snapshot ids and resume; and the classic pipeline SFT -> RM -> PPO-with-RM learning the
held-out task as the verifiable checker measures it."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from integration_helpers import example_config, held_out_rewards

from rollout.config import load_config
from rollout.errors import ConfigError
from rollout.store import open_store

N = 4
RM_GAIN = 0.15  # kl_coef 0.1, seeds 0-4 gained +0.321 / +0.386 / +0.377 / +0.392 / +0.365 on an AVX2-only
# AMD VM (learning_grid.py --algos ppo-rm); at 0.05 seed 0 drifted there and gained +0.114 (README)
SMALL = {
    '"../local/models/sft-warmup"': '"../local/models/tiny"',
    "minibatch_size = 16": "minibatch_size = 3",
    "num_generations = 8": "num_generations = 2",
    "max_tokens = 6": "max_tokens = 4",
    "max_steps = 250": f"max_steps = {N}",
    "every_steps = 50": f"every_steps = {N // 2}",
    "keep_last = 3": "keep_last = 10",
}
CHAT = [{"role": "user", "content": "What is 3+4?"}]
ROOT = Path(__file__).resolve().parents[2]
# The RM PPO trains against is rm-tiny.toml's, which centres its scores (Eisenstein et al., 2023):
# without it the RM keeps per-answer offsets (prior-like: "15" over "3" whatever the question) that
# PPO exploits; centred, its best answer is the right one far more often (see the README).


@pytest.fixture(scope="module")
def tiny_rm(workspace, tmp_path_factory):
    """A reward-model folder shaped like an RM export: the tiny model with a fresh 1-logit head."""
    from rollout.export import export_model_dir
    from rollout.models.load import ModelSource, load_model, load_tokenizer

    source = ModelSource(str(workspace / "models" / "tiny"))
    tokenizer = load_tokenizer(source)
    model = load_model(source, task="reward", pad_token_id=tokenizer.pad_token_id, seed=7)
    return export_model_dir(model, tokenizer, tmp_path_factory.mktemp("rm") / "rm")


def _config(workspace, tmp_path, rm_dir, replace=None):
    """ppo-rm-tiny.toml, small, with its RM at `rm_dir`."""
    return example_config("ppo-rm-tiny.toml", workspace, tmp_path, {
        **SMALL, '"../local/models/rm-tiny"': f'"{rm_dir}"', **(replace or {})})


def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "rollout.cli.main", *args], capture_output=True, text=True, env=env)


# --- the config entry -------------------------------------------------------------------


def test_reward_entries_parse_by_kind_and_function_entries_keep_their_digest(workspace, tiny_rm, tmp_path):
    cfg = load_config(_config(workspace, tmp_path, tiny_rm))
    rm, correct = cfg.algorithm.settings.rewards
    assert (rm.kind, rm.name, rm.model, rm.weight, rm.normalize, rm.batch_size) == (
        "reward_model", "rm", tiny_rm, 1.0, "running", 128)
    assert (correct.kind, correct.name, correct.weight) == ("function", "arithmetic_correct", 0.0)
    dumped = cfg.model_dump(mode="json")["algorithm"]["ppo"]["rewards"]
    assert dumped[1] == {"name": "arithmetic_correct", "weight": 0.0}  # no `kind`: old digests hold
    explicit = load_config(_config(workspace, tmp_path / "b", tiny_rm, {
        'name = "arithmetic_correct"': 'kind = "function"\nname = "arithmetic_correct"'}))
    assert explicit.model_dump(mode="json")["algorithm"] == cfg.model_dump(mode="json")["algorithm"]


def test_validate_accepts_a_reward_model_entry(workspace, tiny_rm, tmp_path):
    out = _cli("validate", "--config", str(_config(workspace, tmp_path, tiny_rm)), "--no-data")
    assert out.returncode == 0 and "config OK: algorithm=ppo" in out.stdout, out.stderr


@pytest.mark.parametrize(("replace", "problem"), [
    ({'model = "RM"': 'model = "../nowhere"'}, "no such folder"),
    ({'model = "RM"': 'model = "TINY"'}, "not a reward model"),
    ({'model = "RM"': 'snapshot = "not-hex"'}, "is not a snapshot id"),
    ({'model = "RM"': 'model = "RM"\nsnapshot = "0123abcd"'}, "exactly one of model"),
    ({'normalize = "running"': 'normalize = "whiten"'}, "normalize"),
    ({'name = "rm"': 'name = "arithmetic_correct"'}, "names must be unique"),
])
def test_bad_reward_model_entries_fail_validate_with_exit_2(workspace, tiny_rm, tmp_path, replace, problem):
    config = _config(workspace, tmp_path, tiny_rm)
    text = config.read_text().replace(f'model = "{tiny_rm}"', 'model = "RM"')
    for old, new in replace.items():
        text = text.replace(old, new)
    config.write_text(text.replace('"RM"', f'"{tiny_rm}"').replace('"TINY"', f'"{workspace}/models/tiny"'))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = "\n".join([str(info.value), *info.value.details])
    where = "algorithm.ppo:" if "unique" in problem else "algorithm.ppo.rewards.0"
    assert problem in message and where in message
    out = _cli("validate", "--config", str(config), "--no-data")
    assert out.returncode == 2 and problem in out.stderr and "Traceback" not in out.stderr


# --- scoring ----------------------------------------------------------------------------


def test_rm_reward_scores_exactly_as_the_rm_scores_its_pairs(tiny_rm):
    """The reward renders prompt + completion as `rollout train rm` renders a pair's side, in batches
    of any size: its scores are the RM's own scores of the same texts."""
    import torch

    from rollout.algorithms.rm import collate_pair_batch, score_sequences
    from rollout.data.jsonl import Row
    from rollout.data.tokenize import tokenize_pairs
    from rollout.rl.reward_model import RewardModelReward, load_reward_model

    rm = load_reward_model(tiny_rm, device=torch.device("cpu"), batch_size=2)
    prompts = [CHAT, CHAT, "What is 1+1? ", [{"role": "user", "content": "What is 9+9?"}]]
    chosen, rejected = ["7", "12", "2", "18"], ["8", " 7 and more", "11", "1"]
    rows = [Row(i + 1, {"prompt": p, "chosen": [{"role": "assistant", "content": c}] if not isinstance(p, str) else c,
                        "rejected": [{"role": "assistant", "content": r}] if not isinstance(p, str) else r})
            for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected, strict=True))]
    pairs, _ = tokenize_pairs(rows, rm.tokenizer, max_seq_len=512)
    with torch.no_grad():
        direct = score_sequences(rm.model, collate_pair_batch(pairs, [0.0] * 4, rm.tokenizer.pad_token_id).tokens)
    scores = rm(prompts * 2, chosen + rejected)
    assert scores == pytest.approx(direct.tolist(), abs=1e-5)
    assert len(set(scores)) == 8  # a fresh head still tells the texts apart
    assert load_reward_model(tiny_rm, device=torch.device("cpu"), batch_size=64)(prompts, chosen) == pytest.approx(
        scores[:4], abs=1e-5)
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training
    grouped = RewardModelReward(rm.model, rm.tokenizer, device=torch.device("cpu"), normalize="group")
    chat = [scores[i] for i in (0, 1, 4, 5)]  # the two CHAT prompts, twice: one group of four
    expected = [s - sum(chat) / 4 for s in scores[:2]] + [(scores[2] - scores[6]) / 2, (scores[3] - scores[7]) / 2]
    assert grouped(prompts * 2, chosen + rejected)[:4] == pytest.approx(expected, abs=1e-5)


def test_normalisation_math():
    from rollout.rl.reward_model import EPS, Moments, normalize_scores

    assert normalize_scores([1.0, 3.0], "none", Moments()) == ([1.0, 3.0], Moments())
    grouped, _ = normalize_scores([1.0, 3.0, 10.0, 20.0, 5.0, 2.0], "group", Moments(), ["a", "a", "b", "b", "c", "a"])
    assert grouped == pytest.approx([-1.0, 1.0, -5.0, 5.0, 0.0, 0.0])  # minus the mean of the same prompt's scores
    batch, moments = normalize_scores([1.0, 3.0, 5.0], "batch", Moments())
    std = math.sqrt(8 / 3)
    assert batch == pytest.approx([-2 / (std + EPS), 0.0, 2 / (std + EPS)]) and moments == Moments()
    first, m1 = normalize_scores([1.0, 3.0], "running", Moments())
    assert (m1.count, m1.mean, m1.std) == (2, 2.0, 1.0) and first == pytest.approx([-1 / (1 + EPS), 1 / (1 + EPS)])
    second, m2 = normalize_scores([5.0, 7.0, 9.0], "running", m1)
    values = [1.0, 3.0, 5.0, 7.0, 9.0]  # the running moments are those of every score so far
    mean = sum(values) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 5)
    assert (m2.count, m2.mean) == (5, pytest.approx(mean)) and m2.std == pytest.approx(std)
    assert second == pytest.approx([(v - mean) / (std + EPS) for v in (5.0, 7.0, 9.0)])


def test_rm_combines_with_other_rewards_by_weight(tiny_rm):
    import torch

    from rollout.algorithms.config import RewardModelSpec
    from rollout.algorithms.config import RewardSpec as FunctionSpec
    from rollout.algorithms.rl_common import resolve_reward_specs
    from rollout.rl.rewards import score_batch

    entries = [RewardModelSpec(kind="reward_model", model=tiny_rm, weight=0.5, normalize="batch"),
               FunctionSpec(name="arithmetic_correct", weight=2.0)]
    specs = resolve_reward_specs(entries, "arithmetic", device=torch.device("cpu"))
    assert [(name, weight) for name, _, weight in specs] == [  # the raw score is logged, the normalised one weighs
        ("rm", 0.0), ("rm_batch", 0.5), ("arithmetic_correct", 2.0), ("env:arithmetic", 1.0)]
    completions = ["7", "8", "7 or 8"]
    rewards, parts, failures = asyncio.run(score_batch(
        specs, [CHAT] * 3, completions, {"answer": ["7"] * 3}, timeout_s=30.0))
    raw = specs[1][1].score([CHAT] * 3, completions)
    mean = sum(raw) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / 3)
    for i, correct in enumerate([1.0, 0.0, 1.0]):
        normalised = (raw[i] - mean) / (std + 1e-6)
        assert parts[i]["rm"] == pytest.approx(raw[i], abs=1e-6)
        assert parts[i]["rm_batch"] == pytest.approx(normalised, abs=1e-5)
        assert rewards[i] == pytest.approx(0.5 * normalised + 2.0 * correct + correct, abs=1e-5)
    assert failures == [None] * 3


# --- in a run: snapshot ids, metrics, resume --------------------------------------------


def test_ppo_with_an_rm_snapshot_logs_both_rewards_and_resumes_bit_identically(workspace, tmp_path):
    """An RM given by snapshot id (a 2-step `train rm` in the same store), running normalisation
    (its moments live in the snapshot): both rewards logged at every step; resume is exact."""
    from rollout.algorithms.ppo import train_ppo
    from rollout.algorithms.rm import train_rm
    from rollout.checkpoint import read_train_state
    from rollout.store import open_object_store

    rm_cfg = load_config(example_config("rm-tiny.toml", workspace, tmp_path, {
        '"../local/models/sft-tiny"': '"../local/models/tiny"', "max_steps = 800": "max_steps = 2",
        "minibatch_size = 64": "minibatch_size = 4", "warmup_steps = 20": "warmup_steps = 0"}))
    rm_snapshot = train_rm(rm_cfg).final_snapshot_id
    config = example_config("ppo-rm-tiny.toml", workspace, tmp_path, {
        **SMALL, 'model = "../local/models/rm-tiny"': f'snapshot = "{rm_snapshot[:12]}"'})
    cfg = load_config(config)
    full = train_ppo(cfg)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    snaps = {s.step: s for s in store.list_snapshots(run_id=full.run_id, kind="train_state")}
    metrics = {name: [m.value for m in store.read_metrics(full.run_id, name=name)]
               for name in ("rollout/reward/rm", "rollout/reward/rm_running", "rollout/reward/arithmetic_correct",
                            "rollout/reward_mean")}
    store.close()
    assert all(len(v) == N for v in metrics.values()), metrics
    assert metrics["rollout/reward_mean"] == pytest.approx(metrics["rollout/reward/rm_running"])  # the RM alone trains
    assert metrics["rollout/reward/rm"] != pytest.approx(metrics["rollout/reward/rm_running"])  # raw: logged beside
    # the verifiable reward (weight 0) is still scored: a mean of 0/1 over each step's 3 x 2 samples
    assert all(abs(6 * v - round(6 * v)) < 1e-9 for v in metrics["rollout/reward/arithmetic_correct"])
    moments = read_train_state(open_object_store("fs", path=cfg.storage.objects.path), snaps[N // 2])[1]["rewards"]
    assert moments["rm_running"]["count"] == 2 * 3 * 2  # steps x prompts x completions scored by the mid-run snapshot
    run_b = train_ppo(cfg, resume=snaps[N // 2].id).run_id
    store = open_store("embedded", path=cfg.storage.embedded.path)
    snap_b = next(s for s in store.list_snapshots(run_id=run_b, kind="train_state") if s.step == N)
    rm_a = [m.value for m in store.read_metrics(full.run_id, name="rollout/reward/rm_running") if m.step > N // 2]
    rm_b = [m.value for m in store.read_metrics(run_b, name="rollout/reward/rm_running")]
    store.close()
    for blob in ("model", "optimizer"):
        assert snap_b.manifest["blobs"][blob]["digest"] == snaps[N].manifest["blobs"][blob]["digest"]
    assert rm_a == rm_b  # normalised by the same running moments after the resume


def test_grpo_takes_a_reward_model_too(workspace, tiny_rm, tmp_path):
    """`[[algorithm.grpo.rewards]]` with kind = "reward_model": trained on, and logged each step."""
    from rollout.algorithms.grpo import train_grpo

    rm_entry = f'kind = "reward_model"\nmodel = "{tiny_rm}"\nnormalize = "group"\n'
    cfg = load_config(example_config("grpo-tiny.toml", workspace, tmp_path, {
        '"../local/models/sft-warmup"': '"../local/models/tiny"', "minibatch_size = 16": "minibatch_size = 2",
        "num_generations = 8": "num_generations = 2", "max_tokens = 6": "max_tokens = 3",
        "max_steps = 250": "max_steps = 2", "dynamic_sampling = true": "dynamic_sampling = false",
        'name = "arithmetic_correct"\nweight = 1.0\n': rm_entry}))
    result = train_grpo(cfg)
    store = open_store("embedded", path=cfg.storage.embedded.path)
    raw = store.read_metrics(result.run_id, name="rollout/reward/rm")
    grouped = [m.value for m in store.read_metrics(result.run_id, name="rollout/reward/rm_group")]
    store.close()
    assert [m.step for m in raw] == [1, 2] and grouped == pytest.approx([0.0, 0.0], abs=1e-6)  # centred per prompt


def test_ppo_scores_with_a_served_rm_as_with_the_same_rm_in_process(workspace, tiny_rm, tmp_path):
    """`url = ...` of `rollout serve --model <RM>` (a real server, real HTTP): the run logs the same RM
    scores at every step as the run that loads the RM in process."""
    import re
    import signal

    from rollout.algorithms.ppo import train_ppo

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ROLLOUT_API_KEY="k")
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli.main", "serve", "--model", str(tiny_rm), "--port", "0",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
        assert url, (line, proc.stderr.read() if proc.poll() is not None else "")
        os.environ["RM_KEY"] = "k"
        runs = {}
        for where, entry in [("local", f'model = "{tiny_rm}"'),
                             ("served", f'url = "{url.group(1)}"\napi_key_env = "RM_KEY"')]:
            cfg = load_config(_config(workspace, tmp_path / where, tiny_rm, {
                f'model = "{tiny_rm}"': entry, "max_steps = 4": "max_steps = 2"}))
            result = train_ppo(cfg)
            store = open_store("embedded", path=cfg.storage.embedded.path)
            runs[where] = [m.value for m in store.read_metrics(result.run_id, name="rollout/reward/rm")]
            store.close()
    finally:
        os.environ.pop("RM_KEY", None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert len(runs["served"]) == 2 and runs["served"] == pytest.approx(runs["local"], abs=1e-5)


# --- learning ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_rm_ppo_pipeline_raises_held_out_verifiable_accuracy(workspace, rm_run, sft_warmup, tmp_path_factory):
    """SFT -> RM (from the SFT model) -> PPO from the warm-up SFT with the RM as its only training
    reward; the held-out sampled accuracy, judged by the verifiable checker, rises. Seed 0 (this
    chain) at one thread: 0.311 -> 0.631, the same at two threads (README, *Learning grid*)."""
    import json

    from rollout.algorithms.ppo import train_ppo

    rm_example = (ROOT / "examples" / "rm-tiny.toml").read_text()
    assert "center_rewards_coefficient = 0.01" in rm_example and "rm_pref.jsonl" in rm_example
    rm_export = rm_run[0].algorithm.settings.export.dir
    rl_dir = tmp_path_factory.mktemp("ppo-rm")
    cfg = load_config(example_config("ppo-rm-tiny.toml", workspace, rl_dir, {
        '"../local/models/sft-warmup"': f'"{sft_warmup}"', '"../local/models/rm-tiny"': f'"{rm_export}"',
        '"../local/models/ppo-rm-tiny"': f'"{rl_dir}/model"'}))
    result = train_ppo(cfg)
    rows = [json.loads(x) for x in (workspace / "data/arithmetic/eval_prompts.jsonl").read_text().splitlines()]

    before, after = (held_out_rewards(path, rows)[1] for path in (sft_warmup, rl_dir / "model"))
    print(f"PPO-with-RM held-out sampled accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + RM_GAIN
    store = open_store("embedded", path=cfg.storage.embedded.path)
    logged = {name: store.read_metrics(result.run_id, name=f"rollout/reward/{name}")
              for name in ("rm", "rm_running", "arithmetic_correct")}
    store.close()
    for metrics in logged.values():  # the RM's score beside the verifiable reward, at every step
        assert [m.step for m in metrics] == list(range(1, result.steps + 1))
    rm = [m.value for m in logged["rm"]]
    assert sum(rm[-20:]) / 20 > sum(rm[:20]) / 20 + 0.5  # the RM's own score rises too (+1.5 to +1.9 measured)
