"""`rollout snapshot ...` through the installed console script, on a real SQLite store.

Tables are read under a pseudo-terminal (`cli_terminal`); piped output and `--json` are JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_terminal import run_in_terminal, table_rows

from rollout.snapshots import Blob, commit_snapshot
from rollout.store import FsObjectStore, open_store

ROLLOUT = Path(sys.executable).parent / "rollout"
LIST_KEYS = {"id", "run_id", "kind", "step", "label", "parent_id", "created_at", "metadata"}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROLLOUT), *args], cwd=cwd, env={**clean_env(), **(env or {})}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.fixture
def workspace(tmp_path):
    """A store with two runs: run A has 4 train_state snapshots (step 1 labeled) and 1 buffer."""
    store = open_store("embedded", path=tmp_path / "rollout.db")
    objects = FsObjectStore(tmp_path / "object-store")
    run_a = store.create_run(algorithm="sft", config_digest="a", config_json="{}").id
    run_b = store.create_run(algorithm="rm", config_digest="b", config_json="{}").id
    committed = []
    for run_id, kind, step, label in [
        (run_a, "train_state", 1, "warm"),
        (run_a, "train_state", 2, None),
        (run_a, "buffer", 2, None),
        (run_b, "train_state", 1, None),
        (run_a, "train_state", 3, None),
        (run_a, "train_state", 4, None),
    ]:
        committed.append(
            commit_snapshot(
                store,
                objects,
                run_id=run_id,
                kind=kind,
                step=step,
                blobs={"state": Blob(f"{run_id}/{kind}/{step}".encode(), meta={"format": "json"})},
                label=label,
                metadata={"step": step},
            )
        )
    store.close()
    return tmp_path, run_a, run_b, committed


def test_list_is_newest_first_json(workspace):
    root, run_a, run_b, committed = workspace
    result = run_cli("snapshot", "list", cwd=root)
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [s["id"] for s in listed] == [r.id for r in reversed(committed)]
    assert all(set(s) == LIST_KEYS for s in listed)
    assert listed[0]["step"] == 4 and listed[0]["metadata"] == {"step": 4}

    result = run_cli(
        "snapshot", "list", "--storage-path", str(root / "rollout.db"), "--run-id", run_a,
        "--kind", "train_state", "--limit", "2", cwd=root.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [(s["run_id"], s["step"]) for s in json.loads(result.stdout)] == [(run_a, 4), (run_a, 3)]


def test_list_table_on_a_terminal(workspace):
    root, run_a, run_b, committed = workspace
    rows = table_rows(run_in_terminal([str(ROLLOUT), "snapshot", "list"], cwd=root, env=clean_env()))
    assert rows[0] == ["id", "kind", "run", "step", "label", "age", "size"]
    assert [row[0] for row in rows[1:]] == [r.id[:12] for r in reversed(committed)]  # newest first
    labeled = rows[-1]  # run A's step 1, the oldest
    assert labeled[:5] == [committed[0].id[:12], "train_state", run_a[:10], "1", "warm"]
    assert re.fullmatch(r"\d+s ago", labeled[5]) and labeled[6] == f"{len(f'{run_a}/train_state/1')} B"
    assert rows[3][:4] == [committed[3].id[:12], "train_state", run_b[:10], "1"]


def test_show_tables_on_a_terminal(workspace):
    root, run_a, _, committed = workspace
    record = committed[2]  # run A's buffer at step 2
    text = run_in_terminal([str(ROLLOUT), "snapshot", "show", record.id[:8]], cwd=root, env=clean_env())
    rows = table_rows(text)
    fields = {row[0]: row[1:] for row in rows}
    assert fields["id"] == [record.id] and fields["kind"] == ["buffer"] and fields["run"] == [run_a]
    assert fields["step"] == ["2"] and fields["metadata"] == ['{"step": 2}']
    size = f"{len(f'{run_a}/buffer/2')} B"
    assert fields["size"] == [size]
    blob = record.manifest["blobs"]["state"]
    assert rows[-1] == ["state", blob["digest"][:12], size, 'format="json"']  # the blobs table


def test_json_on_a_terminal_with_the_flag(workspace):
    root, *_ = workspace
    listed = json.loads(
        run_in_terminal([str(ROLLOUT), "snapshot", "list", "--json"], cwd=root, env=clean_env())
    )
    assert listed == json.loads(run_cli("snapshot", "list", cwd=root).stdout)
    assert all(set(s) == LIST_KEYS for s in listed)
    shown = run_in_terminal(
        [str(ROLLOUT), "snapshot", "show", listed[0]["id"], "--json"], cwd=root, env=clean_env()
    )
    assert json.loads(shown) == json.loads(run_cli("snapshot", "show", listed[0]["id"], cwd=root).stdout)


def test_storage_path_from_environment(workspace, tmp_path_factory):
    root, *_ = workspace
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    result = run_cli(
        "snapshot", "list", cwd=elsewhere, env={"ROLLOUT_STORAGE_PATH": str(root / "rollout.db")}
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 6


def test_show_by_prefix_includes_the_manifest(workspace):
    root, run_a, _, committed = workspace
    record = committed[0]
    result = run_cli("snapshot", "show", record.id[:8], cwd=root)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert set(shown) == LIST_KEYS | {"manifest"}
    assert shown["id"] == record.id and shown["label"] == "warm"
    assert shown["manifest"] == record.manifest
    assert shown["manifest"]["blobs"]["state"]["format"] == "json"


@pytest.mark.parametrize("bad_id", ["deadbeefdeadbeef", "nothex!!", "abc"])
def test_unknown_snapshot_exits_2_with_one_line(workspace, bad_id):
    root, *_ = workspace
    result = run_cli("snapshot", "show", bad_id, cwd=root)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == f"error: snapshot not found: {bad_id}"
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_store_is_an_error_and_is_not_created(tmp_path):
    result = run_cli("snapshot", "list", "--storage-path", "missing.db", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: no store at missing.db"
    assert not (tmp_path / "missing.db").exists()


def test_prune_then_gc(workspace):
    root, run_a, run_b, _ = workspace
    result = run_cli("snapshot", "prune", "--run-id", run_a, "--keep-last", "2", cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pruned 1 snapshots"  # train_state step 2; step 1 is labeled

    result = run_cli(
        "snapshot", "prune", "--run-id", run_a, "--keep-last", "1", "--no-keep-labeled", cwd=root
    )
    assert result.stdout.strip() == "pruned 2 snapshots"
    remaining = json.loads(run_cli("snapshot", "list", cwd=root).stdout)
    assert sorted((s["run_id"] == run_a, s["kind"], s["step"]) for s in remaining) == [
        (False, "train_state", 1),
        (True, "buffer", 2),
        (True, "train_state", 4),
    ]

    result = run_cli("snapshot", "gc", cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "deleted 3 blobs"
    assert run_cli("snapshot", "gc", cwd=root).stdout.strip() == "deleted 0 blobs"


def test_prune_requires_run_id(workspace):
    root, *_ = workspace
    result = run_cli("snapshot", "prune", cwd=root)
    assert result.returncode == 2
    assert "--run-id" in result.stderr


def test_cli_modules_import_no_heavy_dependencies():
    code = (
        "import sys, rollout.cli.snapshot, rollout.cli.runs; "
        "heavy = sorted({'torch', 'transformers', 'safetensors', 'sqlalchemy'} & set(sys.modules)); "
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
