"""`rollout plan` and `rollout run --plan`: the quickstart as a user types it, the lock's drift
checks, located data errors, over-length counts and the memory refusal.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e/test_plan.py -q

Everything goes through the installed `rollout` script. The peak RSS of a run comes from
`os.wait4` in a small launcher process: Linux carries a parent's peak into its child's ru_maxrss
(the child's memory before `exec` is a copy of the parent's), and pytest's own peak is far above
a tiny run's, so the launcher (a bare interpreter) stands between them.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from cli_e2e_helpers import ROLLOUT, assert_ok, assert_user_error, cli_env, run_cli, run_cli_side_by_side

REPO = Path(__file__).resolve().parents[2]
ULID = re.compile(r"run ([0-9A-HJKMNP-TV-Z]{26}) succeeded")
QUICKSTART = (
    "rollout validate --config {config}",
    "rollout plan --config {config} -o plan.lock",
    "rollout run --plan plan.lock",
    "rollout logs tail {run} --config {config}",
)


MEASURE = """
import json, os, subprocess, sys
with open(sys.argv[1], "w") as out, open(sys.argv[2], "w") as err:
    child = subprocess.Popen(sys.argv[3:], stdout=out, stderr=err)
    _, status, usage = os.wait4(child.pid, 0)
print(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "maxrss": usage.ru_maxrss * 1024}))
"""


def run_measured(*args: str | Path, cwd: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    """`rollout ARGS` and its peak RSS in bytes, measured by a launcher that imports nothing heavy."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "out"), Path(folder, "err")
        command = [str(ROLLOUT), *map(str, args)]
        launcher = subprocess.run([sys.executable, "-c", MEASURE, str(out), str(err), *command], cwd=cwd,
                                  env=cli_env(), capture_output=True, text=True, check=True)
        measured = json.loads(launcher.stdout)
        result = subprocess.CompletedProcess(command, measured["returncode"], out.read_text(), err.read_text())
    return result, measured["maxrss"]


def sft_overrides(**block: object) -> dict:
    return {"algorithm": {"sft": {"budget": {"max_steps": 2}, "snapshot": {"every_steps": 2}, **block}}}


# --------------------------------------------------------------------------- the quickstart


def test_quickstart_validate_plan_run_logs_tail(tmp_path: Path, write_config) -> None:
    """The README's quickstart, command for command, on a tiny SFT config; the run's peak RSS is
    within 25% of the plan's estimate."""
    readme = (REPO / "README.md").read_text()
    for command in QUICKSTART:
        shown = command.format(config="examples/sft-tiny.toml", run="<run-id>")
        assert shown in readme, f"README's quickstart lost {shown!r}"
    config = write_config(tmp_path / "sft.toml", "sft", overrides=sft_overrides())

    validate = run_cli(*QUICKSTART[0].format(config=config).split()[1:], cwd=tmp_path)
    assert_ok(validate)
    assert validate.stdout.startswith("config OK: algorithm=sft")
    plan = run_cli(*QUICKSTART[1].format(config=config).split()[1:], cwd=tmp_path)
    assert_ok(plan)
    assert plan.stdout.startswith("plan OK: algorithm=sft"), plan.stdout
    assert re.search(r"^lengths: sequences=64 p50=\d+ .* over_max_seq_len=0 \(truncated\) dropped=0$",
                     plan.stdout, re.M), plan.stdout
    lock = json.loads((tmp_path / "plan.lock").read_text())
    assert lock["lock_version"] == 1 and lock["algorithm"] == "sft"
    roles = {entry["role"] for entry in lock["files"]}
    assert {"config", "model", "tokenizer", "dataset"} <= roles, roles
    assert lock["config"]["algorithm"]["sft"]["scheduler"] == {"kind": "constant", "warmup_steps": 0,
                                                                  "min_lr_ratio": 0.0}  # defaults filled in
    assert {"python", "rollout", "torch", "transformers"} <= lock["packages"].keys()

    run, peak = run_measured(*QUICKSTART[2].split()[1:], cwd=tmp_path)
    assert_ok(run)
    run_id = ULID.search(run.stdout).group(1)
    tail = run_cli(*QUICKSTART[3].format(config=config, run=run_id).split()[1:], cwd=tmp_path)
    assert_ok(tail)
    names = [json.loads(line)["name"] for line in tail.stdout.splitlines()]
    assert names[0] == "train_start" and names[-1] == "train_end" and names.count("train_step") == 2
    estimate = lock["estimate"]["total_bytes"]
    assert abs(estimate / peak - 1) <= 0.25, (estimate, peak, lock["estimate"])


# --------------------------------------------------------------------------- drift


PLUGIN = '''def exact(prompts, completions, answer):
    """1.0 when the completion is the answer."""
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
'''
SIDECAR = """import json, sys
for line in sys.stdin:
    request = json.loads(line)
    if request["method"] == "describe":
        result = {"name": "length", "kinds": ["reward"]}
    else:
        result = {"rewards": [float(len(c)) for c in request["params"]["completions"]]}
    print(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}), flush=True)
"""
GRPO_CONFIG = """schema_version = 1
[algorithm]
kind = "grpo"
[algorithm.grpo]
minibatch_size = 4
num_generations = 2
max_tokens = 4
[[algorithm.grpo.rewards]]
name = "my_rewards:exact"
[[algorithm.grpo.rewards]]
kind = "sidecar"
name = "length"
command = ["{python}", "score.py"]
[algorithm.grpo.base_model]
uri = "{model}"
[algorithm.grpo.optimizer]
kind = "adamw"
lr = 1e-3
[algorithm.grpo.budget]
max_steps = 1
[algorithm.grpo.dataset]
path = "{data}"
[algorithm.grpo.packing]
max_seq_len = 64
[backend]
device = "cpu"
num_threads = 1
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory, tiny_model: Path, arith_data: dict[str, Path]) -> dict[str, Path]:
    """A GRPO config over a copy of the tiny model, a copy of the prompts and a `module:attr`
    reward plugin, planned once; the drift tests each change one byte of one file and put it back."""
    root = tmp_path_factory.mktemp("drift")
    model = shutil.copytree(tiny_model, root / "model")
    data = Path(shutil.copy(arith_data["prompts"], root / "prompts.jsonl"))
    (root / "plugins").mkdir()
    plugin = root / "plugins" / "my_rewards.py"
    plugin.write_text(PLUGIN)
    config = root / "grpo.toml"
    sidecar = root / "score.py"
    sidecar.write_text(SIDECAR)
    config.write_text(GRPO_CONFIG.format(model=model, data=data, python=sys.executable))
    env = plugin_env(root)
    result = subprocess.run([str(ROLLOUT), "plan", "--config", str(config), "-o", str(root / "plan.lock")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert_ok(result)
    assert "reward: my_rewards:exact (my_rewards:exact) exact(prompts, completions, answer); fields: answer\n" \
        in result.stdout
    assert f"reward: length ({sys.executable} score.py) describe: length kinds=reward\n" in result.stdout
    assert re.search(r"^lengths: prompts=64 .* over_max_seq_len=0 \(reported\)", result.stdout, re.M)
    lock = json.loads((root / "plan.lock").read_text())
    roles = {Path(e["path"]).name: e["role"] for e in lock["files"]}
    assert roles == {"grpo.toml": "config", "config.json": "model", "generation_config.json": "model",
                     "model.safetensors": "model", "tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer",
                     "chat_template.jinja": "tokenizer", "prompts.jsonl": "dataset", "my_rewards.py": "plugin",
                     "score.py": "sidecar"}
    assert lock["estimate"]["parts"]["engine"] == lock["estimate"]["parts"]["weights"] > 0  # the engine's copy
    return {"root": root, "lock": root / "plan.lock", "dataset": data, "model": model / "model.safetensors",
            "plugin": plugin, "sidecar": sidecar, "env": env}


def plugin_env(root: Path) -> dict[str, str]:
    return {**cli_env(), "PYTHONPATH": str(root / "plugins")}


@pytest.mark.parametrize(("kind", "role"), [("dataset", "dataset"), ("model", "model"), ("plugin", "plugin"), ("sidecar", "sidecar")])
def test_one_changed_byte_refuses_the_planned_run(planned: dict[str, Path], kind: str, role: str) -> None:
    path = planned[kind]
    original = path.read_bytes()
    middle = len(original) // 2
    path.write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1:])
    try:
        result = subprocess.run([str(ROLLOUT), "run", "--plan", str(planned["lock"])], env=planned["env"],
                                capture_output=True, text=True, timeout=120)
    finally:
        path.write_bytes(original)
    line = assert_user_error(result, f"{planned['lock']}: {path}: {role} file changed since planning")
    assert "nothing ran" in result.stderr
    assert not (planned["root"] / "store").exists(), "a refused run must not open the store"
    assert line.count(str(path)) == 1


def test_an_unchanged_lock_passes_its_check_and_a_new_model_file_does_not(
    planned: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout.plan_lock import check_lock

    monkeypatch.syspath_prepend(str(planned["root"] / "plugins"))  # the plugin's source file is found by module name

    cfg, drift = check_lock(planned["lock"])
    assert drift == [] and cfg.algorithm.kind == "grpo"
    extra = planned["model"].parent / "extra.safetensors"
    extra.write_bytes(b"x")
    try:
        _, drift = check_lock(planned["lock"])
    finally:
        extra.unlink()
    assert [d.message for d in drift] == [f"{extra}: a model file that was not there when planned"]


def test_ranks_started_by_run_plan_do_not_hash_the_pinned_files_again(
    planned: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rollout run --plan` checks the lock, then starts torchrun with `ROLLOUT_LOCK_CHECKED` set to
    the lock's stamp: its ranks take the config without hashing every pinned file again. A rank
    whose stamp does not match the lock (another lock, or none: a bare `torchrun`) checks it."""
    import rollout.cli.plan as plan_cli
    import rollout.plan_lock as plan_lock
    from rollout.errors import ConfigError

    monkeypatch.syspath_prepend(str(planned["root"] / "plugins"))
    ran, hashed = [], []
    monkeypatch.setattr(plan_cli, "run_training", lambda cfg, resume: ran.append(cfg.algorithm.kind))
    digest_file = plan_lock.digest_file
    monkeypatch.setattr(plan_lock, "digest_file", lambda path: hashed.append(path) or digest_file(path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(plan_lock.LOCK_CHECKED_ENV, plan_lock.lock_stamp(planned["lock"]))
    plan_cli.run(planned["lock"], None)
    assert ran == ["grpo"] and hashed == []

    monkeypatch.setenv(plan_lock.LOCK_CHECKED_ENV, "0" * 64)  # not this lock's stamp: the rank checks
    data = planned["dataset"]
    original = data.read_bytes()
    data.write_bytes(original + b"\n")
    try:
        with pytest.raises(ConfigError, match="dataset file changed since planning"):
            plan_cli.run(planned["lock"], None)
    finally:
        data.write_bytes(original)
    assert ran == ["grpo"] and len(hashed) >= 6  # every pinned file hashed (the config, model, tokenizer, ...)


# --------------------------------------------------------------------------- data and lengths


def test_bad_line_17_a_template_that_raises_and_over_length_counts(
    tmp_path: Path, tiny_model: Path, arith_data: dict[str, Path], write_config
) -> None:
    lines = arith_data["sft"].read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:16] + ['{"messages": [{"role": "user"}]}'] + lines[16:]) + "\n")
    bad_config = write_config(tmp_path / "bad" / "sft.toml", "sft", dataset=bad, overrides=sft_overrides())
    # a chat template that refuses one question: plan renders every line and names the one it fails on
    model = shutil.copytree(tiny_model, tmp_path / "model")
    question = json.loads(lines[29])["messages"][0]["content"]
    refused = 1 + next(i for i, line in enumerate(lines) if json.loads(line)["messages"][0]["content"] == question)
    template = model / "chat_template.jinja"
    template.write_text("{%- for m in messages %}{%- if m['content'] == " + json.dumps(question) + " %}"
                        "{{ raise_exception('no such sums') }}{%- endif %}{%- endfor %}" + template.read_text())
    template_config = write_config(tmp_path / "template" / "sft.toml", "sft", overrides=sft_overrides(
        base_model={"uri": str(model), "dtype": "float32"}))
    # arithmetic chats are 17-19 tokens: 16 keeps every sample (an assistant token is left) but cuts some
    short_config = write_config(tmp_path / "short" / "sft.toml", "sft",
                                overrides=sft_overrides(packing={"kind": "off", "max_seq_len": 16}))
    bad_result, template_result, short_result = run_cli_side_by_side(
        ["plan", "--config", bad_config], ["plan", "--config", template_config], ["plan", "--config", short_config])
    assert_user_error(bad_result, f"{bad}:17: ")
    assert_user_error(template_result, f"{arith_data['sft']}:{refused}: the chat template can't render this line:"
                                       " no such sums", exact=True)

    assert_ok(short_result)
    from rollout.data.jsonl import read_rows
    from rollout.data.tokenize import tokenize_sft
    from rollout.models.load import ModelSource, load_tokenizer

    tokenizer = load_tokenizer(ModelSource(str(tiny_model)))
    rows = read_rows(arith_data["sft"], "sft")[0]
    full, _ = tokenize_sft(rows, tokenizer, loss_on="assistant", max_seq_len=10**6)
    _, stats = tokenize_sft(rows, tokenizer, loss_on="assistant", max_seq_len=16)  # what training counts
    assert stats.num_truncated > 0 and stats.num_samples >= 4
    match = re.search(r"^lengths: sequences=64 .* max=(\d+) max_seq_len=16 over_max_seq_len=(\d+) \(truncated\)"
                      r" dropped=(\d+)$", short_result.stdout, re.M)
    assert match, short_result.stdout
    assert [int(g) for g in match.groups()] == [max(len(s.input_ids) for s in full), stats.num_truncated,
                                                stats.num_dropped]


# --------------------------------------------------------------------------- pipelines


FLAKY = '''import os

CALLS = [0]


def reward(prompts, completions, **fields):
    """0.0 for every completion; raises from its second call on while $FLAKY_MARKER exists."""
    CALLS[0] += 1
    if CALLS[0] > 1 and os.path.exists(os.environ["FLAKY_MARKER"]):
        raise RuntimeError("flaky reward: marker present")
    return [0.0 for _ in completions]
'''
STAGE = """schema_version = 1
[algorithm]
kind = "{kind}"
[algorithm.{kind}]
minibatch_size = {batch}
{extra}
[algorithm.{kind}.base_model]
uri = "{model}"
[algorithm.{kind}.optimizer]
kind = "adamw"
lr = 1e-3
[algorithm.{kind}.budget]
max_steps = {steps}
[algorithm.{kind}.snapshot]
every_steps = 1
[algorithm.{kind}.dataset]
path = "{data}"
[algorithm.{kind}.packing]
max_seq_len = 64
{export}
[storage.embedded]
path = "store/rollout.db"
[storage.objects]
path = "store/objects"
[backend]
device = "cpu"
num_threads = 1
"""
PIPELINE = """schema_version = 1
[[stages]]
name = "sft"
config = "sft.toml"
[[stages]]
name = "rm"
config = "rm.toml"
base_model = "sft"
[[stages]]
name = "grpo"
config = "grpo.toml"
base_model = "sft"
reward_model = "rm"
"""


@pytest.mark.slow
def test_a_pipeline_plans_every_stage_and_resumes_the_failed_one(
    tmp_path: Path, tiny_model: Path, arith_data: dict[str, Path]
) -> None:
    """sft -> rm -> grpo scored by the rm: planned at once; grpo fails at step 2 (its reward
    raises), and running the lock again skips sft and rm and resumes grpo from its step-1 snapshot."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "flaky.py").write_text(FLAKY)
    stages = {
        "sft": dict(batch=4, steps=2, data=arith_data["sft"], model=tiny_model, extra="",
                    export='[algorithm.sft.export]\ndir = "out/sft"'),
        "rm": dict(batch=4, steps=1, data=arith_data["pref"], model="out/sft", extra="",
                   export='[algorithm.rm.export]\ndir = "out/rm"'),
        "grpo": dict(batch=2, steps=2, data=arith_data["prompts"], model="out/sft", export="", extra=(
            'num_generations = 2\nmax_tokens = 4\n[[algorithm.grpo.rewards]]\nkind = "reward_model"\n'
            'model = "out/rm"\n[[algorithm.grpo.rewards]]\nname = "flaky:reward"')),
    }
    for kind, fields in stages.items():
        (tmp_path / f"{kind}.toml").write_text(STAGE.format(kind=kind, **fields))
    (tmp_path / "pipeline.toml").write_text(PIPELINE)
    env = {**cli_env(), "PYTHONPATH": str(tmp_path / "plugins"), "FLAKY_MARKER": str(tmp_path / "marker")}

    def rollout(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROLLOUT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)

    plan = rollout("plan", "--config", "pipeline.toml", "-o", "pipeline.lock")
    assert_ok(plan)
    for name in stages:
        assert f"stage {name}: plan OK: algorithm={name}" in plan.stdout
    assert f"stage grpo: reward_model <- stage rm: {tmp_path}/out/rm\n" in plan.stdout
    assert "pipeline OK: 3 stages (sft -> rm -> grpo)" in plan.stdout
    assert not (tmp_path / "out").exists(), "planning runs nothing"

    (tmp_path / "marker").touch()
    first = rollout("run", "--plan", "pipeline.lock")
    assert first.returncode == 2 and "Traceback" not in first.stderr, first.stderr
    assert first.stderr.splitlines()[-1].startswith("error: step 2: 5 rollout batches in a row had no usable"), \
        first.stderr  # after the earlier stages' progress lines
    assert "stage sft: sft\n" in first.stdout and "stage rm: rm\n" in first.stdout
    assert (tmp_path / "out" / "rm" / "config.json").is_file()
    (tmp_path / "marker").unlink()

    second = rollout("run", "--plan", "pipeline.lock")
    assert_ok(second)
    progress = json.loads((tmp_path / "pipeline.lock.progress.json").read_text())["stages"]
    assert f"stage sft: done in run {progress['sft']['run_id']}, skipped" in second.stdout
    assert f"stage rm: done in run {progress['rm']['run_id']}, skipped" in second.stdout
    resumed = re.search(r"^stage grpo: grpo, resuming from snapshot ([0-9a-f]{64})$", second.stdout, re.M)
    assert resumed, second.stdout
    runs = {r["id"]: r for r in json.loads(run_cli("runs", "list", "--json", "--config", tmp_path / "grpo.toml").stdout)}
    final = runs[progress["grpo"]["run_id"]]
    assert final["status"] == "succeeded" and final["resumed_from"] == resumed[1]
    assert sum(r["algorithm"] == "sft" for r in runs.values()) == 1  # the finished stages ran once

    again = rollout("run", "--plan", "pipeline.lock")
    assert_ok(again)
    assert again.stdout.count("skipped") == 3


# --------------------------------------------------------------------------- memory


def test_an_oversized_batch_is_refused_at_plan_time_without_allocating(tmp_path: Path, write_config) -> None:
    """Rows of 1024 tokens, a micro-batch sized to need ~3x this machine's RAM: refused, exit 2,
    while the plan process itself stays small; `rollout train` (plan + run) refuses it the same
    way before any run starts."""
    from rollout.plan_memory import host_memory

    total, _ = host_memory()
    per_row = 70 * 2**20  # tiny model, 1024 tokens: ~60 MiB of activations + ~6 MiB of logits
    rows = -(-3 * total // per_row)
    if rows > 6000:
        pytest.skip(f"{total / 2**30:.0f} GiB of RAM needs {rows} long lines to overflow; too slow for a test")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "numbers", "grow", "quickly", "under", "bright", "lights", "and", "rivers", "flow"]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=460))}) + "\n" for _ in range(rows)))
    config = write_config(tmp_path / "sft.toml", "sft", dataset=data, overrides=sft_overrides(
        minibatch_size=rows, packing={"kind": "off", "max_seq_len": 1024}, loss_on={"kind": "full"}))
    result, peak = run_measured("plan", "--config", config, "-o", tmp_path / "plan.lock", cwd=tmp_path)
    line = assert_user_error(result, "algorithm.sft.minibatch_size: estimated peak memory")
    assert f"{config}:" in line and "does not fit this machine's RAM" in line
    estimate = float(re.search(r"estimated peak memory ([\d.]+) GiB", line)[1]) * 2**30
    assert estimate > total
    assert peak < 2 * 2**30, f"plan itself used {peak / 2**20:.0f} MiB"
    assert not (tmp_path / "plan.lock").exists()
    assert assert_user_error(run_cli("train", "sft", "--config", config), "") == line
    assert not (tmp_path / "store" / "rollout.db").exists()  # no run was started


def test_parameter_count_comes_from_the_safetensors_headers(tiny_model: Path) -> None:
    from rollout.models.tiny import count_saved_parameters
    from rollout.plan_memory import read_model_shape

    shape = read_model_shape(tiny_model)
    assert shape.num_params == count_saved_parameters(tiny_model) == 1_050_752
    assert (shape.hidden_size, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (128, 4, 2, 32)
    # LoRA r=8 on q,v of 4 layers: q 128->128, v 128->64
    assert shape.lora_params(8, ["q_proj", "v_proj"]) == 4 * 8 * ((128 + 128) + (128 + 64))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
