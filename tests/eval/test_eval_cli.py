"""`rollout eval` as a user runs it: the console script against the tiny model, `rollout serve`, and stubs.

Subprocesses that evaluate an endpoint never import torch, so most of these runs take ~1-2 s;
the one in-process hf run (`--model`) and the `rollout serve` fixture pay for torch once each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eval_fakes import FaultyEndpoint, SeedEchoEngine

from rollout.cli.main import main
from rollout.eval.config import EvalConfig
from rollout.eval.harness import EvalData, Target, create_eval_record, execute_eval
from rollout.eval.metrics import summarize
from rollout.eval.runner import to_outcome
from rollout.store import open_store

sys.path[:0] = [str(Path(__file__).parents[1] / "cli"), str(Path(__file__).parents[1] / "store")]
import test_sql_store  # noqa: E402
from cli_terminal import run_in_terminal, table_rows  # noqa: E402

pg_admin, pg_dsn = test_sql_store.pg_admin, test_sql_store.pg_dsn  # a fresh PostgreSQL schema per test

ROLLOUT = Path(sys.executable).parent / "rollout"
HERE = Path(__file__).parent
NUM_PROMPTS = 6


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "EVAL_TEST_", "OPENAI_"))}
    clean.update(
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE), **extra
    )
    return clean


def rollout(*args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROLLOUT), *args], cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=300
    )


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def complete_rows(path: Path) -> list[dict]:
    """The rows of the lines that end in a newline: a process killed while appending may leave the
    last one torn, never one before it."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def comparable(rows: list[dict]) -> list[dict]:
    """A row without what differs between two evals of the same thing (its eval id, its time)."""
    return [{k: v for k, v in r.items() if k not in ("eval_id", "created_at")} for r in rows]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.models.tiny import init_tiny_model
    from rollout.tasks.arithmetic import write_arithmetic_dataset

    root = tmp_path_factory.mktemp("eval-cli")
    init_tiny_model(root / "tiny")
    files = write_arithmetic_dataset(root / "arith", num_train=10, num_eval=50)
    lines = files["eval_prompts"].read_text().splitlines()[:NUM_PROMPTS]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


class Server:
    """`rollout serve` on the tiny model, a subprocess on a free port; `.url` waits until it listens."""

    def __init__(self, model_dir: Path) -> None:
        cmd = [str(ROLLOUT), "serve", "--model", str(model_dir), "--port", "0", "--threads", "1"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
        )
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            match = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
            assert match, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")  # type: ignore[union-attr]
            self._url = match.group(1)
        return self._url

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(workspace: Path):
    """Started now, waited for on first use: it boots while a test does other work."""
    server = Server(workspace / "tiny")
    yield server
    server.stop()


def test_a_snapshot_is_exported_and_evaluated_like_its_model_folder(
    workspace: Path, served: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """In this process (torch is loaded already); `served` is asked for so `rollout serve` boots meanwhile."""
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    from rollout.snapshots import Blob, commit_snapshot
    from rollout.store import FsObjectStore

    model_dir = workspace / "tiny"
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()  # what training snapshots hold
    blobs = {"model_config": Blob((model_dir / "config.json").read_bytes()),
             "model": Blob(save({k: v.clone().contiguous() for k, v in state.items()}))}  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        blobs[f"tokenizer/{name}"] = Blob((model_dir / name).read_bytes())
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="x", config_json="{}")
    snapshot = commit_snapshot(
        store, FsObjectStore(tmp_path / "objects"), run_id=run.id, kind="train_state", step=3, blobs=blobs
    )
    store.close()

    monkeypatch.chdir(tmp_path)
    common = ["eval", "--env", "arithmetic", "--data", str(workspace / "prompts.jsonl"), "--temperature", "0",
              "--max-tokens", "6", "--storage-path", "rollout.db", "--object-path", "objects", "--threads", "1"]  # fmt: skip
    code, out, err = run_main(
        capsys, *common, "--snapshot", snapshot.id[:10], "--output", "snap.jsonl", "--json"
    )
    assert code == 0, err
    snapshot_eval = json.loads(out)["eval_id"]
    code, _, err = run_main(capsys, *common, "--model", str(model_dir), "--output", "dir.jsonl", "--json")
    assert code == 0, err
    assert comparable(read_rows(tmp_path / "snap.jsonl")) == comparable(read_rows(tmp_path / "dir.jsonl"))
    store = open_store("embedded", path=tmp_path / "rollout.db")
    record = store.get_eval(snapshot_eval)
    assert (record.model, record.model_identity) == (f"snapshot:{snapshot.id}", f"snapshot:{snapshot.id}")
    store.close()


def test_model_in_process_and_served_endpoint_agree_at_temperature_0(
    workspace: Path, served: Server, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(workspace)
    common = ["eval", "--env", "arithmetic", "--data", "prompts.jsonl", "--n", "2", "--temperature", "0",
              "--max-tokens", "6", "--k", "1,2", "--json", "--storage-path", "rollout.db"]  # fmt: skip
    # In this process (torch is loaded already), while `rollout serve` boots beside it.
    code, out, err = run_main(capsys, *common, "--model", "tiny", "--output", "hf.jsonl", "--threads", "1")
    assert code == 0, err
    local_out = json.loads(out)
    code, out, err = run_main(capsys, *common, "--base-url", served.url, "--output", "served.jsonl")
    assert code == 0, err
    remote_out = json.loads(out)

    assert (local_out["n_prompts"], local_out["n_samples"]) == (NUM_PROMPTS, 2 * NUM_PROMPTS)
    assert local_out["metrics"] == remote_out["metrics"] and "pass@2" in local_out["metrics"]
    hf_rows, served_rows = read_rows(workspace / "hf.jsonl"), read_rows(workspace / "served.jsonl")
    assert comparable(hf_rows) == comparable(served_rows)  # completions, tokens, rewards, seeds: all equal
    assert all(r["completion_tokens"] >= 1 and r["prompt_tokens"] > 5 for r in hf_rows)
    assert {r["eval_id"] for r in hf_rows} == {local_out["eval_id"]}

    recomputed = summarize([to_outcome(r) for r in hf_rows], ks=[1, 2], seed=0)
    assert recomputed.metrics == local_out["metrics"]  # the printed summary, exactly
    with sqlite3.connect(workspace / "rollout.db") as db:
        (summary,) = db.execute("SELECT summary FROM evals WHERE id = ?", (local_out["eval_id"],)).fetchone()
    assert json.loads(summary)["metrics"] == local_out["metrics"]


def test_tool_env_in_process_and_served_render_the_same_tools(
    workspace: Path, served: Server, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """The calculator env offers its tool: the served chat template must render it as the hf engine does."""
    from transformers import AutoTokenizer

    from rollout.tasks.calculator import calculator_tool, write_calculator_data

    monkeypatch.chdir(workspace)
    files = write_calculator_data(workspace / "calc", n_sft=1, n_train=1, n_eval=4)
    common = ["eval", "--env", "calculator", "--data", str(files["eval_prompts"]), "--temperature", "0",
              "--max-tokens", "8", "--max-turns", "3", "--json", "--storage-path", "rollout.db"]  # fmt: skip
    code, out, err = run_main(capsys, *common, "--model", "tiny", "--output", "calc-hf.jsonl", "--threads", "1")
    assert code == 0, err
    code, out2, err = run_main(capsys, *common, "--base-url", served.url, "--output", "calc-served.jsonl")
    assert code == 0, err
    hf_rows, served_rows = read_rows(workspace / "calc-hf.jsonl"), read_rows(workspace / "calc-served.jsonl")
    assert comparable(hf_rows) == comparable(served_rows) and json.loads(out)["metrics"] == json.loads(out2)["metrics"]
    tok = AutoTokenizer.from_pretrained(workspace / "tiny")
    first = [hf_rows[0]["messages"][0]]
    with_tools = tok.apply_chat_template(first, tools=[calculator_tool().openai_schema()], add_generation_prompt=True)
    without = tok.apply_chat_template(first, add_generation_prompt=True)
    ids = lambda r: r["input_ids"] if hasattr(r, "keys") else r  # noqa: E731
    assert served_rows[0]["prompt_tokens"] == len(ids(with_tools)) > len(ids(without))


def test_sigkill_mid_eval_then_resume_gives_the_uninterrupted_rows_and_metrics(
    workspace: Path, served: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = ["--env", "eval_fakes:HashEnv", "--data", str(workspace / "prompts.jsonl"), "--base-url", served.url,
             "--n", "8", "--temperature", "1.0", "--max-tokens", "6", "--seed", "5", "--k", "1,2,4,8",
             "--max-concurrency", "2", "--storage-path", "rollout.db"]  # fmt: skip
    total = NUM_PROMPTS * 8
    with (tmp_path / "killed.err").open("wb") as err:
        killed = subprocess.Popen(
            [str(ROLLOUT), "eval", *flags, "--output", "rows.jsonl"], cwd=tmp_path, stdout=subprocess.DEVNULL,
            stderr=err, env=env(EVAL_TEST_ENV_SLEEP_S="0.1", ROLLOUT_HEARTBEAT_S="0.2"),
        )  # fmt: skip
    deadline = time.monotonic() + 60
    stored = 0
    while stored == 0:
        assert killed.poll() is None, (tmp_path / "killed.err").read_text()
        assert time.monotonic() < deadline, "no sample stored within 60 s"
        time.sleep(0.05)
        stored = _count_samples(tmp_path / "rollout.db")
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    stored = _count_samples(tmp_path / "rollout.db")
    assert 0 < stored < total
    [(eval_id, status)] = _evals(tmp_path / "rollout.db")
    assert status == "running"  # it never said goodbye
    # The output never holds more than the store. A kill during an append can leave its last line
    # torn (a short write); the resume rewrites the file from the store first.
    assert len(complete_rows(tmp_path / "rows.jsonl")) <= stored
    with (tmp_path / "rows.jsonl").open("a") as f:  # as a kill mid-append leaves it, every time
        f.write('{"eval_id": "' + eval_id + '", "prompt_index": 0, "sam')

    code, _, err = run_main(capsys, "eval", "--resume", eval_id, "--storage-path", "rollout.db")
    assert code == 2 and err.startswith(f"error: eval {eval_id} is still running"), err
    time.sleep(0.6)
    code, out, err = run_main(
        capsys, "eval", "--resume", eval_id[:12], "--heartbeat-timeout", "0.5", "--json", "--storage-path",
        "rollout.db",
    )  # fmt: skip
    assert code == 0, err
    assert f"resuming eval {eval_id} ({stored}/{total} samples stored)" in err
    resumed_out = json.loads(out)

    code, out, err = run_main(capsys, "eval", *flags, "--output", "once.jsonl", "--json")
    assert code == 0, err
    once_out = json.loads(out)
    assert resumed_out["eval_id"] == eval_id and resumed_out["n_samples"] == total
    assert resumed_out["metrics"] == once_out["metrics"]
    assert 0 < once_out["metrics"]["pass@1"] < once_out["metrics"]["pass@8"] <= 1  # a non-trivial eval

    rows = read_rows(tmp_path / "rows.jsonl")  # rewritten from the store at the end: exact
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
        (p, s) for p in range(6) for s in range(8)
    ]
    assert comparable(rows) == comparable(read_rows(tmp_path / "once.jsonl"))
    assert _count_samples(tmp_path / "rollout.db", eval_id) == total  # no duplicates, none missing
    recomputed = summarize([to_outcome(r) for r in rows], ks=[1, 2, 4, 8], seed=5)
    assert recomputed.metrics == resumed_out["metrics"]
    assert dict(_evals(tmp_path / "rollout.db"))[eval_id] == "succeeded"

    changed = tmp_path / "changed.jsonl"
    changed.write_text((workspace / "prompts.jsonl").read_text().replace("What", "So what"))
    code, _, err = run_main(
        capsys, "eval", "--resume", eval_id, "--data", str(changed), "--storage-path", "rollout.db"
    )
    assert code == 2 and err.startswith(f"error: {changed}: the data changed since eval {eval_id} started"), (
        err
    )


def _count_samples(db: Path, eval_id: str | None = None) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db, timeout=30) as conn:
        try:
            where, args = ("WHERE eval_id = ?", (eval_id,)) if eval_id else ("", ())
            return conn.execute(f"SELECT count(*) FROM eval_samples {where}", args).fetchone()[0]
        except sqlite3.OperationalError:  # the tables are not there yet
            return 0


def _evals(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute("SELECT id, status FROM evals ORDER BY created_at").fetchall()


# --------------------------------------------------------------------------- list / show / compare


@pytest.fixture(scope="module")
def two_evals(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A store with two finished evals of the same prompts (seed-echo engine, two seeds)."""
    root = tmp_path_factory.mktemp("eval-listing")
    store = open_store("embedded", path=root / "rollout.db")
    rows = [{"prompt": f"What is {i}?", "answer": str(i % 5)} for i in range(12)]
    data = EvalData(root / "data.jsonl", "e" * 64, rows)
    ids = []
    for seed, name in ((1, "baseline"), (2, "candidate")):
        cfg = EvalConfig(env="eval_fakes:SeedAnswerEnv", model=str(root), n=4, seed=seed, name=name)
        record = create_eval_record(store, cfg, Target("hf", f"model-{name}", None), data)
        execute_eval(store, record, cfg, SeedEchoEngine(), data)
        ids.append(record.id)
    store.close()
    return root, ids[0], ids[1]


def test_list_show_and_compare_as_json(
    two_evals: tuple[Path, str, str], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    root, a, b = two_evals
    monkeypatch.chdir(root)
    monkeypatch.delenv("ROLLOUT_STORAGE_PATH", raising=False)
    listed = json.loads(run_main(capsys, "eval", "list")[1])  # stdout is not a terminal: JSON
    assert [e["id"] for e in listed] == [b, a] and listed[0]["name"] == "candidate"
    assert (listed[0]["status"], listed[0]["n_samples_stored"], listed[0]["n_samples_expected"]) == (
        "succeeded", 48, 48,
    )  # fmt: skip
    assert "config_json" not in listed[0] and "config" not in listed[0]

    shown = json.loads(run_main(capsys, "eval", "show", a[:12], "--json")[1])
    assert shown["id"] == a and shown["config"]["seed"] == 1 and shown["summary"]["metrics"]["pass@1"] >= 0
    assert "resume_with" not in shown

    code, out, err = run_main(capsys, "eval", "compare", a, b, "--json")
    assert code == 0, err
    compared = json.loads(out)
    assert compared["same_data"] and compared["n_shared_prompts"] == 12
    pass1 = compared["metrics"]["pass@1"]
    assert pass1["delta"] == pytest.approx(pass1["b"] - pass1["a"])
    assert pass1["paired_delta"] == pytest.approx(pass1["delta"]) and pass1["ci_low"] <= pass1["ci_high"]
    assert compared["metrics"]["mean_turns"]["ci_low"] is None  # a usage metric: delta only
    assert set(compared["flipped"]) >= {"improved", "regressed", "newly_solved", "no_longer_solved"}

    by_name = json.loads(run_main(capsys, "eval", "compare", "baseline", "candidate", "--json")[1])
    assert by_name == compared  # names pick the newest eval with that name

    code, out, _ = run_main(capsys, "eval", "list", "--table")  # a table although stdout is not a terminal
    assert code == 0 and "candidate" in out and "baseline" in out and not out.lstrip().startswith("[")
    code, _, err = run_main(capsys, "eval", "compare", "baseline", "candidate", "--table")
    assert code == 0
    code, _, err = run_main(capsys, "eval", "list", "--table", "--json")
    assert code == 2 and "error: --json and --table exclude each other" in err


def test_list_show_compare_and_eval_tables_on_a_terminal(two_evals: tuple[Path, str, str]) -> None:
    root, a, b = two_evals
    listed = table_rows(run_in_terminal([str(ROLLOUT), "eval", "list"], cwd=root, env=env()))
    assert listed[0][:4] == ["id", "name", "status", "env"]
    assert listed[1][:3] == [b[:10], "candidate", "succeeded"] and "48/48" in listed[1]

    shown = run_in_terminal([str(ROLLOUT), "eval", "show", a], cwd=root, env=env())
    assert f"eval {a}" in shown and "baseline" in shown and "95% CI" in shown
    assert re.search(r"pass@4\s+[0-9.]+\s+\[[0-9.]+, [0-9.]+\]", shown)

    compared = run_in_terminal([str(ROLLOUT), "eval", "compare", a, b], cwd=root, env=env())
    assert "B - A over 12 shared prompts" in compared and "prompts that flipped" in compared
    assert re.search(r"pass@1\s+[0-9.]+\s+[0-9.]+\s+[-+][0-9.]+\s+\[", compared)

    with FaultyEndpoint() as endpoint:
        text = run_in_terminal(
            [str(ROLLOUT), "eval", "--env", "eval_fakes:HashEnv", "--data", str(workspace_prompts(root)),
             "--base-url", endpoint.base_url, "--n", "2", "--storage-path", "other.db"], cwd=root, env=env(),
        )  # fmt: skip
    assert re.search(r"pass@2\s+[0-9.]+\s+\[[0-9.]+, [0-9.]+\]", text) and "metric" in text


def workspace_prompts(root: Path) -> Path:
    path = root / "hash-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    return path


# --------------------------------------------------------------------------- config files and errors


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process (fast: no subprocess); (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_eval_from_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    workspace_prompts(tmp_path / "cfg")
    with FaultyEndpoint() as endpoint:
        (tmp_path / "cfg" / "eval.toml").write_text(
            f'[eval]\nenv = "eval_fakes:HashEnv"\ndata = "hash-prompts.jsonl"\nbase_url = "{endpoint.base_url}"\n'
            'n = 3\nk = [3, 1]\noutput = "out/rows.jsonl"\n\n[storage]\nbackend = "embedded"\n'
            '[storage.embedded]\npath = "store/evals.db"\n'
        )
        code, out, err = run_main(capsys, "eval", "--config", "cfg/eval.toml", "--seed", "4", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["n_samples"] == 9 and list(result["metrics"])[:2] == ["pass@1", "pass@1_ci_low"]
    assert "pass@3" in result["metrics"] and "pass@2" not in result["metrics"]
    rows = read_rows(tmp_path / "cfg" / "out" / "rows.jsonl")  # relative to the config file
    assert len(rows) == 9 and rows[0]["completion"].startswith("ok ")
    store = open_store("embedded", path=tmp_path / "cfg" / "store" / "evals.db")
    record = store.get_eval(result["eval_id"])
    assert (record.seed, record.n, record.engine) == (4, 3, "openai")
    assert record.summary["metrics"] == result["metrics"]
    store.close()

    code, out, err = run_main(capsys, "eval", "list", "--config", "cfg/eval.toml", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)] == [result["eval_id"]]


def test_an_eval_whose_env_is_a_sidecar(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """SPEC section 11: a sidecar table is accepted wherever an env is: `tests/plugins/sidecars/env.py`
    runs each episode (two turns; a turn scores 1.0 when the reply holds the row's answer) in its
    own process, and the eval records it as "sidecar:env.py"."""
    monkeypatch.chdir(tmp_path)
    sidecar = Path(__file__).resolve().parents[1] / "plugins" / "sidecars" / "env.py"
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": "ok" if i % 2 else "nope"}) + "\n" for i in range(4))
    )
    with FaultyEndpoint() as endpoint:
        (tmp_path / "eval.toml").write_text(
            f'[eval]\nenv = {{kind = "sidecar", command = {json.dumps([sys.executable, str(sidecar)])}}}\n'
            f'data = "prompts.jsonl"\nbase_url = "{endpoint.base_url}"\nn = 2\noutput = "rows.jsonl"\n\n'
            '[storage]\nbackend = "embedded"\n[storage.embedded]\npath = "evals.db"\n'
        )
        code, out, err = run_main(capsys, "eval", "--config", "eval.toml", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["n_samples"] == 8
    rows = read_rows(tmp_path / "rows.jsonl")
    assert {row["turns"] for row in rows} == {2}
    # a turn scores 1.0 when the reply holds the answer ("ok" is in every reply the endpoint makes),
    # else len(reply) / 10; two turns an episode
    for row in rows:
        expected = 2.0 if row["prompt_index"] % 2 else sum(len(m["content"]) / 10 for m in row["messages"][1::2])
        assert row["reward"] == pytest.approx(expected) and row["success"] == (row["prompt_index"] % 2 == 1), row
    store = open_store("embedded", path=tmp_path / "evals.db")
    record = store.get_eval(result["eval_id"])
    store.close()
    assert record.env == "sidecar:env.py"
    assert EvalConfig.model_validate_json(record.config_json).env.command == (sys.executable, str(sidecar))


def test_an_eval_stored_in_postgres_is_listed_and_resumed(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = workspace_prompts(tmp_path)
    with FaultyEndpoint() as endpoint:
        args = [
            "--env",
            "eval_fakes:HashEnv",
            "--data",
            str(data),
            "--base-url",
            endpoint.base_url,
            "--n",
            "2",
        ]
        code, out, err = run_main(capsys, "eval", *args, "--dsn", pg_dsn, "--json")
        assert code == 0, err
        first = json.loads(out)
        code, out, err = run_main(capsys, "eval", "--resume", first["eval_id"], "--dsn", pg_dsn, "--json")
        assert code == 0, err  # nothing missing: the same summary again
        assert json.loads(out) == first
    code, out, _ = run_main(capsys, "eval", "list", "--dsn", pg_dsn, "--json")
    [listed] = json.loads(out)
    assert (listed["id"], listed["n_samples_stored"], listed["engine"]) == (first["eval_id"], 6, "openai")
    assert listed["timings"]["sessions"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "nope", "--data", "d.jsonl", "--model", "m"], "error: unknown env 'nope'"),
        (
            ["--env", "arithmetic", "--data", "missing.jsonl", "--model", "m"],
            "error: dataset not found: missing.jsonl",
        ),
        (
            ["--env", "arithmetic", "--data", "bad.jsonl", "--model", "m"],
            'bad.jsonl:2: missing field "prompt"',
        ),
        (
            ["--env", "arithmetic", "--data", "noanswer.jsonl", "--model", "m"],
            'noanswer.jsonl:3: the arithmetic env needs an "answer" field',
        ),
        (
            ["--env", "arithmetic", "--data", "d.jsonl", "--model", "m", "--base-url", "http://x/v1"],
            "error: give one of --model, --snapshot or --base-url, not --model and --base-url",
        ),
        (
            ["--env", "arithmetic", "--data", "d.jsonl"],
            "eval: give exactly one of model, snapshot or base_url",
        ),
        (["--env", "arithmetic", "--data", "d.jsonl", "--model", "nowhere"], "nowhere: not a model folder"),
        (
            ["--env", "arithmetic", "--data", "d.jsonl", "--base-url", "http://127.0.0.1:9/v1"],
            "error: cannot reach endpoint http://127.0.0.1:9/v1",
        ),
        (
            ["--env", "arithmetic", "--data", "d.jsonl", "--snapshot", "0123abcd"],
            "error: snapshot not found: 0123abcd",
        ),
        (["--resume", "01NOPE0000"], "error: eval not found: 01NOPE0000"),
        (
            ["--resume", "01NOPE0000", "--n", "3"],
            "error: --resume runs with the eval's recorded parameters; drop --n",
        ),
        (["--env", "arithmetic", "--k", "0,1"], "error: --k: every k must be >= 1"),
        (
            ["--env", "arithmetic", "--data", "d.jsonl", "--model", "m", "--n", "2", "--k", "1,4"],
            "eval: every k must be <= n = 2 (got k = 4)",
        ),
        (["--config", "bad.toml"], "bad.toml:2: eval.n: must be greater than or equal to 1"),
        (["--n", "2", "list"], "error: `rollout eval list` takes its own options"),
        (["show", "01NOPE0000"], "error: eval not found: 01NOPE0000"),
        (["compare", "01NOPE0000", "01NOPE0001"], "error: eval not found: 01NOPE0000"),
    ],
)
def test_bad_input_exits_2_with_one_error_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("ROLLOUT_STORAGE_PATH", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "d.jsonl").write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    (tmp_path / "noanswer.jsonl").write_text('{"prompt": "ok", "answer": "1"}\n\n{"prompt": "no answer"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok", "answer": "1"}\n{"answer": "2"}\n')
    (tmp_path / "bad.toml").write_text('[eval]\nn = 0\nenv = "arithmetic"\nmodel = "m"\n')
    open_store("embedded", path=tmp_path / "rollout.db").close()
    code, _, err = run_main(capsys, "eval", *args)
    assert code == 2, err
    assert err.startswith("error: ") and message in err.splitlines()[0], err
