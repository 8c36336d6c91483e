"""A training process killed with SIGKILL: its run becomes `crashed`, and `--resume` picks it up.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli/test_crashed_runs.py -q

On SQLite and on PostgreSQL (skipped when the server is unreachable). The
trainer beats every 0.5 s (`ROLLOUT_HEARTBEAT_S`); readers judge with a 2 s
`--heartbeat-timeout`, so the test waits seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollout.store import open_store

PG_BASE_DSN = os.environ.get("ROLLOUT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
HEARTBEAT_S = 0.5
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model and the arithmetic SFT data (64 lines: 16 micro-batches of 4 an epoch)."""
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("inputs")
    model = init_tiny_model(root / "tiny")
    data = write_arithmetic_dataset(root / "arithmetic", num_train=64, num_eval=8)
    return Path(model).resolve(), data["sft"].resolve()


@pytest.fixture
def pg_dsn():
    """A DSN whose search_path is a fresh schema, dropped after the test; a skip when unreachable."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install 'rollout[postgres]')")
    try:
        admin = psycopg.connect(PG_BASE_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at {PG_BASE_DSN}: {str(err).strip().splitlines()[0]}")
    schema = f"rollout_test_{uuid.uuid4().hex[:16]}"
    admin.execute(f'CREATE SCHEMA "{schema}"')
    yield f"{PG_BASE_DSN}?options=-csearch_path%3D{schema}"
    admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    admin.close()


def write_config(path: Path, *, model: Path, data: Path, max_steps: int, dsn: str | None) -> Path:
    """A tiny SFT run with a train_state snapshot every 2 steps; SQLite beside the config unless `dsn`."""
    root = path.parent
    storage = (
        f'backend = "postgres"\nruns_dir = "{root / "runs"}"\n[storage.postgres]\ndsn = "{dsn}"\n'
        if dsn
        else f'backend = "embedded"\n[storage.embedded]\npath = "{root / "rollout.db"}"\n'
    )
    path.write_text(
        f"""schema_version = 1
seed = 0

[storage]
{storage}
[storage.objects]
backend = "fs"
path = "{root / "objects"}"

[algorithm]
kind = "sft"

[algorithm.sft]
minibatch_size = 4
gradient_accumulation = 1
base_model = {{ uri = "{model}", dtype = "float32" }}
optimizer = {{ kind = "adamw", lr = 1e-3 }}
budget = {{ max_steps = {max_steps} }}
dataset = {{ kind = "jsonl_path", path = "{data}" }}
packing = {{ kind = "off", max_seq_len = 64 }}
loss_on = {{ kind = "assistant" }}
snapshot = {{ every_steps = 2, keep_last = 3 }}

[backend]
kind = "torch"
device = "cpu"
num_threads = 1

[distributed]
kind = "local"
""",
        encoding="utf-8",
    )
    return path


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["ROLLOUT_HEARTBEAT_S"] = str(HEARTBEAT_S)
    return env


def rollout(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "rollout.cli.main", *map(str, args)],
        env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def wait_for(condition, *, what: str, process: subprocess.Popen, logs: Path, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if process.poll() is not None:
            pytest.fail(f"training exited ({process.returncode}) before {what}:\n{logs.read_text()}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s:\n{logs.read_text()}")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_killed_run_is_crashed_and_resumes(backend, tiny_inputs, tmp_path, request):
    model, data = tiny_inputs
    dsn = request.getfixturevalue("pg_dsn") if backend == "postgres" else None
    config = write_config(tmp_path / "sft.toml", model=model, data=data, max_steps=100_000, dsn=dsn)
    store = open_store("postgres", dsn=dsn) if dsn else None
    logs = tmp_path / "train.log"
    with logs.open("wb") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "rollout.cli.main", "train", "sft", "--config", str(config)],
            env=cli_env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        if store is None:  # the trainer creates the SQLite file
            db = tmp_path / "rollout.db"
            wait_for(db.exists, what="the store", process=trainer, logs=logs)
            store = open_store("embedded", path=db)
        run = wait_for(lambda: store.list_runs(), what="a run", process=trainer, logs=logs)[0]
        wait_for(
            lambda: store.list_snapshots(run_id=run.id, kind="train_state"),
            what="a train_state snapshot", process=trainer, logs=logs,
        )  # fmt: skip
        # Alive for longer than the timeout, and the heartbeat keeps it `running`.
        while time.time() - store.get_run(run.id).started_at < 2 * TIMEOUT_S:
            time.sleep(0.2)
        listed = json.loads(
            rollout("runs", "list", "--heartbeat-timeout", TIMEOUT_S, "--json", "--config", config).stdout
        )
        assert [(r["id"], r["status"]) for r in listed] == [(run.id, "running")]
        assert trainer.poll() is None

        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    latest = store.list_snapshots(run_id=run.id, kind="train_state", limit=1)[0]
    assert store.get_run(run.id).status == "running"  # nobody has looked yet
    time.sleep(TIMEOUT_S + 1.0)

    listed = json.loads(
        rollout("runs", "list", "--heartbeat-timeout", TIMEOUT_S, "--json", "--config", config).stdout
    )
    assert [(r["id"], r["status"]) for r in listed] == [(run.id, "crashed")]
    assert listed[0]["error"] == f"no heartbeat for {TIMEOUT_S:g} s (process died?)"
    shown = json.loads(rollout("runs", "show", run.id, "--json", "--config", config).stdout)
    assert (shown["status"], shown["resume_from"]) == ("crashed", latest.id)  # stored once noticed

    resume = write_config(
        tmp_path / "resume.toml", model=model, data=data, max_steps=latest.step + 2, dsn=dsn
    )
    rollout("train", "sft", "--config", resume, "--resume", shown["resume_from"])
    runs = {r["id"]: r for r in json.loads(rollout("runs", "list", "--json", "--config", config).stdout)}
    (resumed,) = [r for r in runs.values() if r["id"] != run.id]
    assert (resumed["status"], resumed["resumed_from"]) == ("succeeded", latest.id)
    assert runs[run.id]["status"] == "crashed"
    assert store.final_metrics(resumed["id"])  # it trained
    assert max(m.step for m in store.read_metrics(resumed["id"])) == latest.step + 2
    store.close()


def test_a_bad_heartbeat_interval_fails_before_any_run_row(tiny_inputs, tmp_path):
    """`$ROLLOUT_HEARTBEAT_S` is read before the run row exists: exit 2, one error line, no stray `pending` run."""
    model, data = tiny_inputs
    config = write_config(tmp_path / "run.toml", model=model, data=data, max_steps=2, dsn=None)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ROLLOUT_HEARTBEAT_S": "soon"}
    out = subprocess.run([sys.executable, "-m", "rollout.cli.main", "train", "sft", "--config", str(config)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: $ROLLOUT_HEARTBEAT_S must be a positive number"), out.stderr
    store = open_store("embedded", path=tmp_path / "rollout.db")
    try:
        assert store.list_runs() == []
    finally:
        store.close()
