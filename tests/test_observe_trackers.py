"""`[observe]` trackers: TensorBoard, W&B (offline) and MLflow (a file store) get every metric at the
store's steps and the resolved config, read back with each tool's own reader; a failing tracker is
dropped with one warning while the run goes on; a tracker whose package is missing is refused at
validate time.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/pytest tests/test_observe_trackers.py -q   # ~30 s on 2 cores

One real run: `rollout train sft` (4 steps on the tiny model, `[eval]` every 2 steps) with all three
trackers on; the failure cases drive a `RunRecorder` directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.cli.main import main
from rollout.config import MlflowConfig, ObserveConfig, parse_config
from rollout.errors import ConfigError
from rollout.observe import RunRecorder
from rollout.observe_trackers import (
    MLFLOW_PARAM_MAX_CHARS,
    flatten_params,
    group_metrics_by_step,
    mlflow_metric_name,
    open_tracker_sinks,
)
from rollout.store import EventRecord, MetricRecord, open_store

BIN = Path(sys.executable).parent
OBSERVE = """
[observe]
tensorboard = true
[observe.wandb]
project = "rollout-test"
mode = "offline"
[observe.mlflow]
tracking_uri = "mlruns"
experiment = "arith"
"""


@pytest.fixture(autouse=True)
def trackers_stay_local(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B in this process and in the CLI's: quiet, offline, its settings and caches in a temp folder;
    MLflow's file store allowed."""
    home = tmp_path_factory.getbasetemp() / "wandb-home"
    for name, value in {
        "WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # for the readers here (the sink sets it for a file: URI)
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("trackers")
    init_tiny_model(root / "tiny")
    write_arithmetic_dataset(root / "arith", num_train=64, num_eval=16)
    return root


def sft_config(workspace: Path, dest: Path, observe: str) -> Path:
    """4 SFT steps on the tiny model, `[eval]` at steps 2 and 4, then `observe`."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "sft.toml"
    path.write_text(f"""schema_version = 1
seed = 0
name = "trackers"
[storage.embedded]
path = "{dest}/rollout.db"
[storage.objects]
path = "{dest}/objects"
[algorithm]
kind = "sft"
[algorithm.sft]
minibatch_size = 4
[algorithm.sft.budget]
max_steps = 4
[algorithm.sft.dataset]
path = "{workspace}/arith/sft.jsonl"
[algorithm.sft.base_model]
uri = "{workspace}/tiny"
[algorithm.sft.optimizer]
kind = "adamw"
lr = 1e-2
[eval]
every_steps = 2
env = "arithmetic"
data = "{workspace}/arith/eval_prompts.jsonl"
max_prompts = 4
n = 2
max_tokens = 4
{observe}""")
    return path


# --------------------------------------------------------------------------- readers, one per tool


def store_metrics(db: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    store = open_store("embedded", path=db)
    try:
        out: dict[str, list[tuple[int, float]]] = {}
        for m in store.read_metrics(run_id):
            out.setdefault(m.name, []).append((m.step, m.value))
        return out
    finally:
        store.close()


def read_tensorboard(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """({tag: [(step, value)]}, the `config` text) through TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    [text] = events.Tensors("config/text_summary")
    return scalars, text.tensor_proto.string_val[0].decode()


def read_wandb(run_dir: Path, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], dict, dict]:
    """({key: [(step, value)]}, the run's config, the run record) from the offline run's `.wandb`
    transaction log, decoded by W&B's own reader (`wandb leet inspect --json`)."""
    [log] = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    out = subprocess.run([str(BIN / "wandb"), "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    run: dict = {}
    for line in out.splitlines():
        record = json.loads(line)
        if record["type"] == "history":
            step = int(record["history"]["step"]["num"])
            for key, value in record["history"]["item"].items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((step, value))
        elif record["type"] == "run":
            run = record["run"]
            config.update(run["config"]["update"])
        elif record["type"] == "config":
            config.update(record["config"].get("update", {}))
    config.pop("_wandb", None)
    return history, config, run


def mlflow_run(tracking_uri: str, experiment: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], f"tags.`rollout.run_id` = '{run_id}'"
    )
    return client, run


# --------------------------------------------------------------------------- a real run


def test_sft_run_mirrors_every_metric_and_the_config_to_each_tracker(workspace, tmp_path):
    config = sft_config(workspace, tmp_path / "run", OBSERVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(BIN / "rollout"), "train", "sft", "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "warning: tracker" not in done.stderr, done.stderr
    [run_id] = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("run ")]
    run_dir = tmp_path / "run" / "runs" / run_id
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["observe"]["mlflow"]["tracking_uri"] == (tmp_path / "run" / "mlruns").resolve().as_uri()

    stored = store_metrics(tmp_path / "run" / "rollout.db", run_id)
    assert [step for step, _ in stored["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in stored["eval/pass@1"]] == [2, 4]
    assert len(stored) > 8  # train/*, perf/*, eval/*: every one of them is compared below

    scalars, text = read_tensorboard(run_dir / "tensorboard")
    assert scalars.keys() == stored.keys()
    for name, points in stored.items():  # TensorBoard keeps float32
        assert [s for s, _ in scalars[name]] == [s for s, _ in points], name
        assert [v for _, v in scalars[name]] == pytest.approx([v for _, v in points], rel=1e-6), name
    assert json.loads("\n".join(line.removeprefix("    ") for line in text.splitlines())) == resolved

    history, wandb_config, wandb_run = read_wandb(run_dir, run_id)
    assert history == stored
    assert wandb_config == resolved
    assert (wandb_run["run_id"], wandb_run["project"], wandb_run["display_name"]) == (
        run_id, "rollout-test", "trackers"
    )

    client, run = mlflow_run(resolved["observe"]["mlflow"]["tracking_uri"], "arith", run_id)
    assert run.info.run_name == run_id and run.info.status == "FINISHED"
    assert run.data.tags["rollout.algorithm"] == "sft"
    for name, points in stored.items():
        logged = client.get_metric_history(run.info.run_id, mlflow_metric_name(name))
        assert sorted((m.step, m.value) for m in logged) == points, name
    params = run.data.params
    assert params["algorithm.kind"] == "sft"
    assert params["algorithm.sft.optimizer.lr"] == "0.01"
    assert params["algorithm.sft.budget.max_steps"] == "4"
    assert params["eval.env"] == "arithmetic"
    artifact = client.download_artifacts(run.info.run_id, "rollout-config.json", str(tmp_path / "artifacts"))
    assert json.loads(Path(artifact).read_text()) == resolved


# --------------------------------------------------------------------------- failures


@pytest.fixture
def store(tmp_path):
    opened = open_store("embedded", path=tmp_path / "rollout.db")
    yield opened
    opened.close()


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(store, tmp_path, capfd):
    run_id = store.create_run(algorithm="sft", config_digest="d", config_json="{}").id
    mlruns = tmp_path / "mlruns"
    observe = ObserveConfig(tensorboard=True, mlflow=MlflowConfig(tracking_uri=mlruns.as_uri()))
    sinks = open_tracker_sinks(observe, run_id=run_id, run_name=None, algorithm="sft", run_dir=tmp_path / run_id,
                               runs_dir=tmp_path, config={"seed": 0})
    assert [s.name for s in sinks] == ["tensorboard", "mlflow"]
    recorder = RunRecorder(store, run_id, tmp_path / run_id / "events.jsonl", sinks=sinks)
    for step in (1, 2):
        recorder.metrics(step, {"train/loss": 1.0 / step})
    recorder.flush()
    client, run = mlflow_run(mlruns.as_uri(), "rollout", run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (1, 1.0), (2, 0.5)
    ]
    shutil.rmtree(mlruns)
    mlruns.write_text("the disk went away\n")  # every write under mlruns/ now fails with an OSError

    for step in (3, 4, 5):
        recorder.metrics(step, {"train/loss": 1.0 / step})
        recorder.flush()  # no error reaches the training loop
    recorder.close()

    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: tracker mlflow failed: "), warnings
    assert "the run goes on without it" in warnings[0]
    assert sinks[1].error is not None and sinks[0].error is None
    assert [(m.step, m.value) for m in store.read_metrics(run_id)] == [(s, 1.0 / s) for s in range(1, 6)]
    scalars, _ = read_tensorboard(tmp_path / run_id / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]


def test_a_tracker_that_cannot_start_is_left_out_with_one_warning(tmp_path, capfd):
    (tmp_path / "file").write_text("not a folder\n")
    observe = ObserveConfig(mlflow=MlflowConfig(tracking_uri=(tmp_path / "file" / "mlruns").as_uri()))
    sinks = open_tracker_sinks(observe, run_id="R1", run_name=None, algorithm="sft", run_dir=tmp_path / "R1",
                               runs_dir=tmp_path, config={})
    assert sinks == []
    [warning] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning.startswith("warning: tracker mlflow cannot start: ")


# --------------------------------------------------------------------------- config


BASE = """schema_version = 1
[algorithm]
kind = "sft"
[algorithm.sft]
minibatch_size = 4
[algorithm.sft.base_model]
uri = "org/model"
[algorithm.sft.optimizer]
kind = "adamw"
lr = 1e-3
[algorithm.sft.budget]
max_steps = 1
[algorithm.sft.dataset]
path = "data.jsonl"
"""


@pytest.mark.parametrize(("module", "block", "line"), [
    ("tensorboard", "[observe]\ntensorboard = true\n", 16),
    ("wandb", "[observe.wandb]\nproject = \"p\"\n", 15),
    ("mlflow", "[observe]\nmlflow = { experiment = \"e\" }\n", 16),
])
def test_a_tracker_whose_package_is_missing_is_refused_at_validate_time(
    module, block, line, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
    config = tmp_path / "run.toml"
    config.write_text(BASE + block)
    with pytest.raises(ConfigError) as err:
        parse_config(config.read_text(), source=config)
    assert str(err.value) == (
        f"{config}:{line}: observe.{module}: the {module} package is not installed: pip install 'rollout[trackers]'"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["validate", "--config", str(config), "--no-data"])
    assert exit_.value.code == 2
    assert "pip install 'rollout[trackers]'" in capsys.readouterr().err


def test_observe_is_off_by_default_and_keeps_the_digest(tmp_path):
    plain = parse_config(BASE, source=tmp_path / "run.toml")
    assert not plain.observe.enabled()
    assert "observe" not in json.loads(plain.canonical_json())  # digests of configs without [observe] stand
    on = parse_config(BASE + '[observe.mlflow]\ntracking_uri = "../mlruns"\n', source=tmp_path / "cfg" / "run.toml")
    assert on.observe.mlflow is not None
    assert on.observe.mlflow.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    assert json.loads(on.canonical_json())["observe"]["mlflow"]["experiment"] == "rollout"
    assert on.digest() != plain.digest()
    http = parse_config(BASE + '[observe.mlflow]\ntracking_uri = "http://127.0.0.1:5000"\n', source=tmp_path / "r.toml")
    assert http.observe.mlflow is not None and http.observe.mlflow.tracking_uri == "http://127.0.0.1:5000"


# --------------------------------------------------------------------------- pure helpers


def test_mlflow_names_spell_out_what_mlflow_refuses():
    assert mlflow_metric_name("train/loss") == "train/loss"
    assert mlflow_metric_name("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_metric_name("eval/pass^4") == "eval/pass_hat_4"
    assert mlflow_metric_name("eval/maj@2_ci_low") == "eval/maj_at_2_ci_low"
    assert mlflow_metric_name("a%b") == "a_b"


def test_config_params_are_flat_and_cut_to_mlflows_limit():
    params = dict(flatten_params({"a": {"b": 1, "c": None, "d": [1, 2]}, "e": "x" * 7000, "f": True}))
    assert params == {"a.b": "1", "a.c": "null", "a.d": "[1, 2]", "e": "x" * 5997 + "...", "f": "true"}
    assert len(params["e"]) == MLFLOW_PARAM_MAX_CHARS


def test_metrics_group_by_step_in_queue_order():
    records = [
        MetricRecord("r", 1, "a", 1.0), EventRecord("r", 0, 0.0, "e", {}), MetricRecord("r", 1, "b", 2.0),
        MetricRecord("r", 2, "a", 3.0), MetricRecord("r", 2, "a", 4.0), MetricRecord("r", 3, "a", 5.0),
    ]
    assert group_metrics_by_step(records) == [(1, {"a": 1.0, "b": 2.0}), (2, {"a": 4.0}), (3, {"a": 5.0})]
