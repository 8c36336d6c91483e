"""Tool use is learned: the demo's calculator SFT on tool-call traces, held-out, asserted.

Its own file so that `make test` (whole files per xdist worker) runs it beside test_learning.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import example_config

from rollout.config import load_config

pytestmark = pytest.mark.slow


def _eval_pass1(capsys, model_dir, data, store_path) -> float:
    """Greedy pass@1 of `rollout eval` on the calculator env (tool calls parsed, run and answered)."""
    from rollout.cli.main import main

    args = ["eval", "--env", "calculator", "--data", str(data), "--model", str(model_dir), "--temperature", "0",
            "--max-turns", "3", "--max-tokens", "48", "--json", "--storage-path", str(store_path), "--threads", "1"]  # fmt: skip
    capsys.readouterr()
    try:
        main(args)
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["metrics"]["pass@1"]


def test_calculator_tool_use_is_learned_from_traces(workspace, sft_run, tmp_path, capsys):
    """The demo's tool-use SFT: from the arithmetic SFT model, on calculator traces.

    Held-out: 200 products the traces never show, greedy, up to 3 turns (a call, the tool's
    answer, the final answer). Measured on one 2-core VM (1 thread, training seeds 0 / 1 / 2,
    8000 traces): the model without traces 0.0 / 0.0 / 0.0, the traced model (2500 steps) 0.80 /
    0.815 / 0.84. Not yet robust across machines: with an AVX2-only CPU's kernels
    (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2) the same budget gave 0.52 / 0.67 on
    seeds 0 / 2 (see examples/tools-sft-tiny.toml and the README). This test runs seed 0 and
    asserts the issue's 0.60. The GRPO stage that follows in the demo is not asserted here."""
    from rollout.algorithms.sft import train_sft
    from rollout.tasks.calculator import write_calculator_data

    data = write_calculator_data(workspace / "data" / "calculator")["eval_prompts"]
    sft_export = sft_run[0].algorithm.settings.export.dir
    store = tmp_path / "evals.db"
    without_tool = _eval_pass1(capsys, sft_export, data, store)  # never saw a tool call: must compute itself
    sft_cfg = load_config(example_config("tools-sft-tiny.toml", workspace, tmp_path / "sft", {
        '"../local/models/sft-tiny"': f'"{sft_export}"',
    }))
    train_sft(sft_cfg)
    sft_acc = _eval_pass1(capsys, sft_cfg.algorithm.settings.export.dir, data, store)
    print(f"calculator pass@1: no tool traces {without_tool:.3f}, tools SFT {sft_acc:.3f}")
    assert without_tool <= 0.05
    assert sft_acc >= 0.60
