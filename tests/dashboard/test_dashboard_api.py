"""The dashboard's JSON API and pages over real stores (SQLite, and PostgreSQL when reachable).

    OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/dashboard/test_dashboard_api.py
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from dashboard_helpers import (
    GRPO_STEPS,
    RM_STEPS,
    SFT_STEPS,
    DashboardStore,
    grpo_reward,
    sft_loss,
    write_runs,
)
from fastapi.testclient import TestClient

from rollout.dashboard.app import LOOPBACK_HOSTS, DashboardSettings, create_app
from rollout.store import open_store

ROLLOUT = Path(sys.executable).parent / "rollout"
PG_BASE_DSN = os.environ.get("ROLLOUT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
UNKNOWN_ULID = "01ARZ3NDEKTSV4RRFFQ69G5FAV"


def client_for(made: DashboardStore, **settings: object) -> TestClient:
    storage_args = ("--storage-path", str(made.path)) if made.path else ()
    return TestClient(create_app(made.store, DashboardSettings(storage_args=storage_args, **settings)))  # type: ignore[arg-type]


@pytest.fixture
def client(dashboard_store: DashboardStore) -> TestClient:
    return client_for(dashboard_store)


def test_runs_listing(client, dashboard_store):
    made = dashboard_store
    body = client.get("/api/runs").json()
    runs = {r["name"]: r for r in body["runs"]}
    assert [r["name"] for r in body["runs"]] == ["grpo-tiny", "rm-tiny", "sft-tiny"]  # newest first
    assert runs["sft-tiny"]["id"] == made.sft_id and runs["sft-tiny"]["algorithm"] == "sft"
    assert [(r["status"], r["crashed"], r["last_step"]) for r in body["runs"]] == [
        ("running", False, GRPO_STEPS),
        ("crashed", True, RM_STEPS),
        ("succeeded", False, SFT_STEPS),
    ]
    assert runs["sft-tiny"]["latest"] == pytest.approx({"train/loss": sft_loss(SFT_STEPS)})
    assert runs["rm-tiny"]["latest"] == pytest.approx({"train/loss": 0.69 - 0.02 * RM_STEPS, "train/accuracy": 0.5 + 0.03 * RM_STEPS})
    assert runs["grpo-tiny"]["latest"]["rollout/reward_mean"] == pytest.approx(grpo_reward(GRPO_STEPS))
    assert runs["grpo-tiny"]["latest"]["eval/pass@1"] == 0.625  # each at its own last step (20)
    assert runs["rm-tiny"]["error"].startswith("no heartbeat")
    assert runs["sft-tiny"]["last_train_state_id"] == made.snapshot_ids[-1]
    for run in body["runs"]:
        assert 0 <= run["age_s"] < 60 and run["duration_s"] is not None and run["duration_s"] >= 0

    assert [r["name"] for r in client.get("/api/runs?status=crashed").json()["runs"]] == ["rm-tiny"]
    assert len(client.get("/api/runs?limit=2").json()["runs"]) == 2
    assert client.get("/api/runs?status=exploded").status_code == 400
    assert client.get("/api/runs?limit=0").status_code == 422


def test_run_detail_by_id_and_prefix(client, dashboard_store):
    made = dashboard_store
    run = client.get(f"/api/runs/{made.sft_id}").json()
    assert run["id"] == made.sft_id and run["status"] == "succeeded" and run["terminal"] is True
    assert run["metric_names"] == ["perf/tokens_per_s", "train/grad_norm", "train/loss", "train/lr"]
    assert run["final_metrics"]["train/loss"] == pytest.approx(sft_loss(SFT_STEPS))
    assert run["resume_from"] is None and run["resume_command"] is None  # succeeded: nothing to resume
    assert client.get(f"/api/runs/{made.sft_id[:10].lower()}").json()["id"] == made.sft_id

    grpo = client.get(f"/api/runs/{made.grpo_id}").json()
    assert grpo["status"] == "running" and grpo["terminal"] is False and grpo["stale"] is False
    assert grpo["metric_names"] == ["eval/pass@1", "rollout/reward_mean", "train/grad_norm", "train/kl", "train/loss"]
    assert grpo["last_step"] == GRPO_STEPS and grpo["final_metrics"]["eval/pass@1"] == 0.625


def test_metrics_series_since_and_name(client, dashboard_store):
    made = dashboard_store
    body = client.get(f"/api/runs/{made.sft_id}/metrics").json()
    loss = body["series"]["train/loss"]
    assert [step for step, _ in loss] == list(range(1, SFT_STEPS + 1))
    assert [value for _, value in loss] == pytest.approx([sft_loss(s) for s in range(1, SFT_STEPS + 1)])
    assert body["last_step"] == SFT_STEPS and len(body["series"]) == 4

    since = client.get(f"/api/runs/{made.sft_id}/metrics?since=30&name=train/loss").json()
    assert list(since["series"]) == ["train/loss"]
    assert [step for step, _ in since["series"]["train/loss"]] == list(range(30, SFT_STEPS + 1))  # inclusive

    grad_norm = client.get(f"/api/runs/{made.grpo_id}/metrics?name=train/grad_norm").json()["series"]["train/grad_norm"]
    assert len(grad_norm) == GRPO_STEPS and grad_norm[6] == [7, None]  # NaN: null (a gap), not invalid JSON

    made.train_grpo(range(GRPO_STEPS + 1, GRPO_STEPS + 6))  # the run goes on training
    more = client.get(f"/api/runs/{made.grpo_id}/metrics?since={GRPO_STEPS}").json()
    reward = more["series"]["rollout/reward_mean"]
    assert [step for step, _ in reward] == list(range(GRPO_STEPS, GRPO_STEPS + 6))
    assert reward[-1][1] == pytest.approx(grpo_reward(GRPO_STEPS + 5)) and more["last_step"] == GRPO_STEPS + 5

    assert client.get(f"/api/runs/{made.sft_id}/metrics?since=-1").status_code == 422
    assert client.get(f"/api/runs/{made.sft_id}/metrics?name=no%20such%20metric").json()["series"] == {}
    assert client.get(f"/api/runs/{made.sft_id}/metrics?name={'x' * 501}").status_code == 422
    assert client.get(f"/api/runs/{made.rm_id}/metrics?since=999").json() == {
        "run_id": made.rm_id, "series": {}, "last_step": None,
    }  # fmt: skip


def test_events_after_seq_and_tail(client, dashboard_store):
    made = dashboard_store
    url = f"/api/runs/{made.sft_id}/events"
    every = client.get(f"{url}?limit=1000").json()["events"]
    assert [e["seq"] for e in every] == list(range(SFT_STEPS + 2))
    assert every[0]["name"] == "run_started" and every[-1]["fields"] == {"status": "succeeded"}
    assert [e["seq"] for e in client.get(f"{url}?after_seq=39").json()["events"]] == [40, 41]
    assert [e["seq"] for e in client.get(f"{url}?tail=true&limit=5").json()["events"]] == [37, 38, 39, 40, 41]
    assert [e["seq"] for e in client.get(f"{url}?tail=true&limit=100").json()["events"]] == list(range(42))
    assert client.get(f"/api/runs/{made.rm_id}/events?tail=true").json()["events"] == []  # none logged
    # a last seq that is not a power of two minus one, far from the start: the search still finds it
    made.train_grpo(range(GRPO_STEPS + 1, GRPO_STEPS + 80))
    last = made.grpo_next_seq - 1
    assert last == 105  # 25 steps, 2 events at step 20, 79 more steps: 106 events, seq 0..105
    tail = client.get(f"/api/runs/{made.grpo_id}/events?tail=true&limit=3").json()["events"]
    assert [e["seq"] for e in tail] == [last - 2, last - 1, last]
    assert tail[-1]["name"] == "train_step" and tail[-1]["fields"]["step"] == GRPO_STEPS + 79


def test_snapshots_with_commands_that_work(client, dashboard_store, tmp_path):
    made = dashboard_store
    snapshots = client.get(f"/api/runs/{made.sft_id}/snapshots").json()["snapshots"]
    assert [s["step"] for s in snapshots] == [40, 30, 20, 10]  # newest first
    newest = snapshots[0]
    assert newest["id"] == made.snapshot_ids[-1] and newest["label"] == "final"
    assert newest["size_bytes"] == 3_276_800 + 6_553_600
    short = made.snapshot_ids[-1][:12]
    assert newest["resume_command"] == f"rollout train sft --config CONFIG --resume {short}"
    export = shlex.split(newest["export_command"])
    assert export == ["rollout", "snapshot", "export", short, f"./export-{short}", "--storage-path", str(made.path)]
    # The copied storage flags find the snapshot from anywhere (the path is absolute).
    shown = subprocess.run(
        [str(ROLLOUT), "snapshot", "show", short, "--json", *export[5:]],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == made.snapshot_ids[-1]
    (grpo_snapshot,) = client.get(f"/api/runs/{made.grpo_id}/snapshots").json()["snapshots"]
    assert grpo_snapshot["id"] == made.grpo_snapshot_id and grpo_snapshot["step"] == 20
    assert grpo_snapshot["resume_command"].startswith("rollout train grpo --config CONFIG --resume ")


def test_evals_listing(client, dashboard_store):
    made = dashboard_store
    evals = client.get("/api/evals").json()["evals"]
    assert [e["id"] for e in evals] == [made.grpo_eval_id, made.eval_id]  # newest first
    e = evals[1]
    assert (e["id"], e["run_id"], e["step"], e["status"], e["env"]) == (made.eval_id, made.sft_id, 40, "succeeded", "arithmetic")
    assert e["metrics"] == {"pass@1": 0.4375, "mean_reward": 0.4375, "avg@4": "NaN"}
    assert e["samples_stored"] == 0 and e["n_prompts"] * e["n"] == 64
    assert [x["id"] for x in client.get(f"/api/evals?run_id={made.sft_id[:12]}").json()["evals"]] == [made.eval_id]
    (grpo_eval,) = client.get(f"/api/evals?run_id={made.grpo_id}").json()["evals"]
    assert (grpo_eval["id"], grpo_eval["step"], grpo_eval["metrics"]["pass@1"]) == (made.grpo_eval_id, 20, 0.625)
    assert client.get(f"/api/evals?run_id={UNKNOWN_ULID}").status_code == 404


@pytest.mark.parametrize("suffix", ["", "/metrics", "/events", "/snapshots"])
def test_unknown_and_malformed_ids(client, suffix):
    unknown = client.get(f"/api/runs/{UNKNOWN_ULID}{suffix}")
    assert unknown.status_code == 404 and unknown.json()["detail"] == f"run not found: {UNKNOWN_ULID}"
    for bad in ["not-a-run", "01ARZ3ND", "ILOU0123456789", "x" * 27, "%2e%2e%2f%2e%2e%2fetc"]:
        response = client.get(f"/api/runs/{bad}{suffix}")
        assert response.status_code in (400, 404), (bad, response.status_code)
        assert response.status_code == 400 or "run" not in response.text
    assert client.get(f"/api/runs/not-a-run{suffix}").json()["detail"].startswith("run id: expected a ULID")


def test_pages_assets_and_no_traversal(client, dashboard_store):
    page = client.get("/")
    assert page.status_code == 200 and "/static/dashboard.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get(f"/runs/{dashboard_store.sft_id}").text == page.text  # one shell, the script routes
    assert client.get("/compare?runs=a,b").text == page.text
    assert client.get("/runs/bad!id").status_code == 400
    script = client.get("/static/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert client.get("/static/dashboard.css").status_code == 200
    for path in ["/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py", "/static/%2e%2e/%2e%2e/store/sql.py"]:
        response = client.get(path)
        assert response.status_code == 404, path
        assert "create_app" not in response.text
    assert client.get("/api/runs").headers["cache-control"] == "no-store"


def test_bearer_key(dashboard_store):
    client = client_for(dashboard_store, api_key="s3cret")
    for path in ["/api/runs", f"/api/runs/{dashboard_store.sft_id}/metrics", "/api/evals"]:
        missing = client.get(path)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    # The pages and assets hold no data: the page loads, then asks for the key.
    assert client.get("/").status_code == 200 and client.get("/static/dashboard.js").status_code == 200


def test_stale_running_run_shown_crashed_without_writing(dashboard_store):
    made = dashboard_store
    client = client_for(made, heartbeat_timeout_s=0.0)  # every running run is silent for longer than 0 s
    runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
    grpo = runs["grpo-tiny"]
    assert (grpo["status"], grpo["stored_status"], grpo["crashed"], grpo["stale"]) == ("crashed", "running", True, True)
    assert grpo["error"].startswith("no heartbeat for")
    detail = client.get(f"/api/runs/{made.grpo_id}").json()
    assert detail["terminal"] is True and detail["resume_from"] == made.grpo_snapshot_id
    assert detail["resume_command"] == f"rollout train grpo --config CONFIG --resume {made.grpo_snapshot_id[:12]}"
    assert made.store.get_run(made.grpo_id).status == "running"  # read-only: the store still says running


def test_loopback_only_host_headers(dashboard_store):
    client = client_for(dashboard_store, allowed_hosts=LOOPBACK_HOSTS)
    assert client.get("/api/runs", headers={"Host": "127.0.0.1:8080"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "localhost"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "attacker.example:8080"}).status_code == 400


@pytest.fixture
def pg_store():
    psycopg = pytest.importorskip("psycopg", reason="psycopg not installed (pip install 'rollout[postgres]')")
    try:
        admin = psycopg.connect(PG_BASE_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at {PG_BASE_DSN}: {str(err).strip().splitlines()[0]}")
    schema = f"rollout_dash_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE SCHEMA "{schema}"')
    store = open_store("postgres", dsn=f"{PG_BASE_DSN}?options=-csearch_path%3D{schema}")
    try:
        yield store
    finally:
        store.close()
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        admin.close()


def test_postgres_store(pg_store):
    made = write_runs(pg_store)
    client = client_for(made)
    assert [r["status"] for r in client.get("/api/runs").json()["runs"]] == ["running", "crashed", "succeeded"]
    loss = client.get(f"/api/runs/{made.sft_id}/metrics?name=train/loss").json()["series"]["train/loss"]
    assert len(loss) == SFT_STEPS and loss[-1][1] == pytest.approx(sft_loss(SFT_STEPS))
    assert [e["seq"] for e in client.get(f"/api/runs/{made.sft_id}/events?tail=true&limit=2").json()["events"]] == [40, 41]


def test_cli_errors_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    missing = subprocess.run(
        [str(ROLLOUT), "dashboard", "--storage-path", str(tmp_path / "nope.db")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: no store at {tmp_path / 'nope.db'}")
    open_store("embedded", path=tmp_path / "rollout.db").close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [str(ROLLOUT), "dashboard", "--storage-path", str(tmp_path / "rollout.db"), "--port", str(port)],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
    assert busy.returncode == 2 and busy.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}"), busy.stderr


def test_export_lines_never_show_a_dsn(tmp_path, monkeypatch):
    from rollout.cli.dashboard import _storage_args
    from rollout.cli.snapshot import StorageFlags

    monkeypatch.delenv("ROLLOUT_OBJECT_PATH", raising=False)
    monkeypatch.delenv("ROLLOUT_STORAGE_PATH", raising=False)
    assert _storage_args(StorageFlags(dsn="postgresql://me:hunter2@db/rollout")) == ("--dsn", "DSN")
    monkeypatch.chdir(tmp_path)
    assert _storage_args(StorageFlags()) == ("--storage-path", str(tmp_path / "rollout.db"))
    monkeypatch.setenv("ROLLOUT_OBJECT_PATH", "blobs")
    assert _storage_args(StorageFlags(config=Path("run.toml"))) == (
        "--config", str(tmp_path / "run.toml"), "--object-path", str(tmp_path / "blobs"),
    )  # fmt: skip
