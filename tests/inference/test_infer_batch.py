"""`rollout infer batch`: resumable after kill -9, located input errors, snapshot ids as models, config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.errors import ConfigError, DataError, StorageError
from rollout.inference import SamplingParams
from rollout.inference.batch import read_batch_input, resume_output, run_batch
from rollout.inference.config import load_inference_config
from rollout.inference.hf_engine import load_hf_engine
from rollout.inference.models import resolve_model

ROLLOUT = Path(sys.executable).parent / "rollout"
NUM_INPUTS = 60


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def _write_inputs(path: Path) -> Path:
    lines = []
    for i in range(NUM_INPUTS):
        prompt = (
            f"What is {i % 10}+{i // 10}?" if i % 2 else [{"role": "user", "content": f"What is {i % 7}+1?"}]
        )
        lines.append(json.dumps({"prompt": prompt, "answer": i % 10, "id": f"q{i}"}))
        if i == 30:
            lines.append("   ")  # blank lines are skipped, and keep their place in the line count
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_midway_then_rerun_gives_one_line_per_input(tmp_path: Path, tiny_model_dir: Path) -> None:
    inputs, output = _write_inputs(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    flags = ["--temperature", "1.0", "--max-tokens", "24", "--seed", "3", "--ignore-eos"]
    cmd = [
        str(ROLLOUT),
        "infer",
        "batch",
        "--model",
        str(tiny_model_dir),
        "--input",
        str(inputs),
        "--output",
        str(output),
        "--batch-size",
        "2",
        "--threads",
        "1",
        *flags,
    ]
    with (tmp_path / "first.err").open("wb") as err:
        first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env())
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_bytes().count(b"\n") >= 4):
        assert first.poll() is None, (tmp_path / "first.err").read_text()
        assert time.monotonic() < deadline, "no output lines within 120 s"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    done_before = len(_read_output(output))
    assert 4 <= done_before < NUM_INPUTS
    with output.open("ab") as f:  # what a kill in the middle of a write leaves behind
        f.write(b'{"id": "0123456789abcdef", "completion": "tor')

    second = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert second.returncode == 0, second.stderr
    assert (
        f"{NUM_INPUTS - done_before} samples" in second.stdout
        and f"{done_before} were already there" in second.stdout
    )
    rows = _read_output(output)
    assert len(rows) == NUM_INPUTS
    assert len({r["id"] for r in rows}) == NUM_INPUTS
    assert sorted(r["index"] for r in rows) == list(range(NUM_INPUTS))
    for r in rows:
        assert (
            r["input_id"] == f"q{r['index']}" and r["answer"] == r["index"] % 10
        )  # extra fields pass through
        assert len(r["token_ids"]) == len(r["logprobs"]) == r["usage"]["completion_tokens"] == 24
        assert r["finish_reason"] == "length"

    # The interrupted-and-resumed file holds exactly what one uninterrupted run writes.
    engine = load_hf_engine(tiny_model_dir, max_batch_size=16)
    identity = resolve_model(
        str(tiny_model_dir), storage_path=tmp_path / "x.db", object_path=tmp_path / "x"
    ).identity
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3, ignore_eos=True, n=1)
    run_batch(engine, read_batch_input(inputs), params, output=tmp_path / "once.jsonl", identity=identity)
    once = {r["id"]: (r["token_ids"], r["completion"]) for r in _read_output(tmp_path / "once.jsonl")}
    assert once == {r["id"]: (r["token_ids"], r["completion"]) for r in rows}


def test_bad_input_line_exits_2_before_loading_a_model(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 5}\n{"text": "x"}\n')
    r = subprocess.run(
        [
            str(ROLLOUT),
            "infer",
            "batch",
            "--model",
            str(tmp_path / "no-model"),
            "--input",
            str(bad),
            "--output",
            str(tmp_path / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 2
    first = r.stderr.splitlines()[0]
    assert first.startswith("error: ") and f"{bad}:2: " in first and "prompt" in first
    assert f"{bad}:3: " in r.stderr


def test_missing_model_exits_2(tmp_path: Path) -> None:
    good = tmp_path / "in.jsonl"
    good.write_text('{"prompt": "ok"}\n')
    r = subprocess.run(
        [
            str(ROLLOUT),
            "infer",
            "batch",
            "--model",
            "deadbeef00",
            "--input",
            str(good),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--storage-path",
            str(tmp_path / "none.db"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: no store at"), r.stderr


def test_resume_cuts_a_torn_line_and_refuses_foreign_lines(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "compl')
    assert resume_output(out, {"a", "b", "c"}) == {"a", "b"}
    assert out.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    with pytest.raises(DataError, match=r"out.jsonl:2: sample b is not part of this run"):
        resume_output(out, {"a"})
    out.write_bytes(b'{"id": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"out.jsonl:2: not a line written by"):
        resume_output(out, {"a"})


def test_snapshot_id_is_exported_once_and_served(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.checkpoint import model_file_blobs
    from rollout.snapshots import Blob, commit_snapshot
    from rollout.store import FsObjectStore, open_store

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    blobs = {name: Blob(data) for name, data in model_file_blobs(model, tokenizer).items()}
    blobs["model"] = Blob(save({k: v.clone().contiguous() for k, v in model.state_dict().items()}))
    db, objects = tmp_path / "rollout.db", tmp_path / "object-store"
    store = open_store("embedded", path=db)
    run = store.create_run(algorithm="sft", config_digest="x", config_json="{}")
    record = commit_snapshot(
        store, FsObjectStore(objects), run_id=run.id, kind="train_state", step=1, blobs=blobs
    )
    store.close()

    resolved = resolve_model(record.id[:10], storage_path=db, object_path=objects)
    assert resolved.path == str((objects / "exports" / record.id).resolve())
    assert resolved.identity == f"snapshot:{record.id}"
    stamp = (Path(resolved.path) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(record.id, storage_path=db, object_path=objects) == resolved
    assert (Path(resolved.path) / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not re-exported
    params = SamplingParams(temperature=0, max_tokens=8)
    from_snapshot = load_hf_engine(resolved.path).generate(["What is 3+8?"], params)
    from_dir = load_hf_engine(tiny_model_dir).generate(["What is 3+8?"], params)
    assert from_snapshot[0][0].token_ids == from_dir[0][0].token_ids
    with pytest.raises(StorageError):
        resolve_model("0123abcd", storage_path=db, object_path=objects)


def test_inference_config_errors_are_located(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'schema_version = 1\n[inference]\nengine = "hf"\nmax_batch_size = 0\n'
        "[inference.sampling]\ntop_pp = 0.5\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_inference_config(cfg)
    messages = [str(caught.value), *caught.value.details]
    assert f"{cfg}:4: inference.max_batch_size: must be greater than or equal to 1 (got 0)" in messages
    assert f"{cfg}:6: inference.sampling.top_pp: unknown field" in messages
    cfg.write_text('[inference]\nmodel = "./models/m"\n[inference.sampling]\ntemperature = 0.5\n')
    loaded = load_inference_config(cfg)
    assert loaded.model == str(tmp_path / "models" / "m") and loaded.sampling.temperature == 0.5
