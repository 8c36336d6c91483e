"""Short real `rollout train sft|rm` runs, then everything a user does next through the CLI.

The runs themselves are the session fixtures `sft_run` (4 steps, a snapshot
every 2) and `rm_run` (2 steps, a snapshot every step), both with an
`[algorithm.<kind>.export]` block; see conftest.py.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e/test_cli_train_smoke.py -q
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from cli_e2e_helpers import TrainedRun, assert_ok, run_cli, run_cli_side_by_side

ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
SNAPSHOT_ID = re.compile(r"[0-9a-f]{64}")
PROMPT = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"


def show_run(run: TrainedRun) -> dict:
    result = run_cli("runs", "show", run.run_id, "--storage-path", run.storage_db)
    assert_ok(result)
    return json.loads(result.stdout)


def list_snapshots(run: TrainedRun) -> list[dict]:
    result = run_cli("snapshot", "list", "--run-id", run.run_id, *run.storage_flags())
    assert_ok(result)
    return json.loads(result.stdout)


def tail_events(run: TrainedRun) -> list[dict]:
    result = run_cli("logs", "tail", run.run_id, "--storage-path", run.storage_db)
    assert_ok(result)
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_progress_lines_follow_the_log_level(sft_run, rm_run):
    """Not a TTY: plain `step=N/T` lines on stderr at the default level (info), none at `warning`
    (the rm run was started as `rollout --log-level warning train rm`); stdout is the same either way."""
    steps = [line for line in sft_run.stderr.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in steps] == ["step=1/4", "step=2/4", "step=3/4", "step=4/4"], sft_run.stderr
    assert all(re.fullmatch(r"step=\d/4 loss=\S+ tok/s=\d+", line) for line in steps), steps
    assert "step=" not in rm_run.stderr, rm_run.stderr
    assert rm_run.stdout.startswith("run "), rm_run.stdout


@pytest.fixture(scope="module")
def exports(tmp_path_factory, sft_run, rm_run) -> dict[str, Path]:
    """`rollout snapshot export FINAL OUT` of both runs, side by side; {kind: OUT}."""
    runs = {"sft": sft_run, "rm": rm_run}
    outs = {kind: tmp_path_factory.mktemp(f"{kind}_export") / "model" for kind in runs}
    results = run_cli_side_by_side(
        *(
            ["snapshot", "export", run.final_snapshot_id, outs[kind], *run.storage_flags()]
            for kind, run in runs.items()
        )
    )
    for (kind, run), result in zip(runs.items(), results, strict=True):
        assert_ok(result)
        assert result.stdout.strip() == str(outs[kind])
        written = json.loads((outs[kind] / "rollout_snapshot.json").read_text())
        assert written == {
            "snapshot_id": run.final_snapshot_id,
            "run_id": run.run_id,
            "step": written["step"],
        }
    return outs


def logits_of(auto_class_name: str, model_dir: Path):
    """Logits of the model in `model_dir` on a fixed prompt, tokenised by its own tokenizer."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = getattr(transformers, auto_class_name).from_pretrained(model_dir).eval()
    batch = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        return batch["input_ids"], model(**batch).logits


def assert_same_model(auto_class_name: str, exported: Path, reference: Path) -> None:
    ids, logits = logits_of(auto_class_name, exported)
    ref_ids, ref_logits = logits_of(auto_class_name, reference)
    assert ids.tolist() == ref_ids.tolist()
    assert logits.shape == ref_logits.shape
    assert (logits - ref_logits).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- sft


def test_sft_train_prints_run_and_snapshot(sft_run):
    assert ULID.fullmatch(sft_run.run_id), sft_run.stdout
    assert SNAPSHOT_ID.fullmatch(sft_run.final_snapshot_id), sft_run.stdout
    assert f"run {sft_run.run_id} succeeded after 4 steps" in sft_run.stdout
    assert "Traceback" not in sft_run.stderr
    assert sft_run.events_dir == sft_run.storage_db.parent / "runs" / sft_run.run_id
    assert (sft_run.export_dir / "config.json").is_file()


def test_sft_runs_show(sft_run):
    shown = show_run(sft_run)
    assert shown["id"] == sft_run.run_id
    assert shown["status"] == "succeeded" and shown["error"] is None
    assert shown["algorithm"] == "sft"
    final = shown["final_metrics"]
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(final)
    assert all(math.isfinite(v) for v in final.values())
    assert final["train/loss"] > 0 and final["perf/tokens_per_s"] > 0
    assert final["train/lr"] == pytest.approx(1e-3)
    assert sft_run.final_snapshot_id in shown["snapshot_ids"]


def test_sft_logs_tail_matches_events_file(sft_run):
    events = tail_events(sft_run)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    names = [e["name"] for e in events]
    assert names[0] == "train_start" and names[-1] == "train_end"
    assert names.count("train_step") == 4 and names.count("snapshot_saved") == 2
    assert [e["fields"]["step"] for e in events if e["name"] == "train_step"] == [1, 2, 3, 4]
    first_snapshot = names.index("snapshot_saved")
    assert names[:first_snapshot].count("train_step") == 2  # every_steps = 2
    assert events[-1]["fields"]["final_snapshot_id"] == sft_run.final_snapshot_id
    assert all(e["run_id"] == sft_run.run_id and e["type"] == "event" for e in events)

    lines = (sft_run.events_dir / "events.jsonl").read_text().splitlines()
    in_file = [line for line in map(json.loads, lines) if line["type"] == "event"]
    assert in_file == events


def test_sft_snapshot_list_then_prune(sft_run):
    listed = list_snapshots(sft_run)
    assert [s["step"] for s in listed] == [4, 2]  # newest first
    assert listed[0]["id"] == sft_run.final_snapshot_id
    assert {s["kind"] for s in listed} == {"train_state"} and {s["run_id"] for s in listed} == {
        sft_run.run_id
    }
    assert all("manifest" not in s for s in listed)

    result = run_cli(
        "snapshot", "prune", "--run-id", sft_run.run_id, "--keep-last", "1", *sft_run.storage_flags()
    )
    assert_ok(result)
    assert result.stdout.strip() == "pruned 1 snapshots"
    assert [s["id"] for s in list_snapshots(sft_run)] == [sft_run.final_snapshot_id]


def test_sft_snapshot_export_loads_and_matches(sft_run, exports):
    out = exports["sft"]
    assert json.loads((out / "rollout_snapshot.json").read_text())["step"] == 4
    assert_same_model("AutoModelForCausalLM", out, sft_run.export_dir)


# --------------------------------------------------------------------------- rm


def test_rm_train_show_list(rm_run):
    assert f"run {rm_run.run_id} succeeded after 2 steps" in rm_run.stdout
    assert "Traceback" not in rm_run.stderr
    shown = show_run(rm_run)
    assert shown["status"] == "succeeded" and shown["algorithm"] == "rm"
    assert {"train/loss", "train/accuracy", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(
        shown["final_metrics"]
    )
    assert [s["step"] for s in list_snapshots(rm_run)] == [2, 1]
    names = [e["name"] for e in tail_events(rm_run)]
    assert names[0] == "train_start" and names[-1] == "train_end" and names.count("train_step") == 2


def test_rm_snapshot_export_loads_and_matches(rm_run, exports):
    out = exports["rm"]
    assert json.loads((out / "rollout_snapshot.json").read_text())["step"] == 2
    assert_same_model("AutoModelForSequenceClassification", out, rm_run.export_dir)
    _, logits = logits_of("AutoModelForSequenceClassification", out)
    assert logits.shape == (1, 1)  # one scalar reward per sequence
