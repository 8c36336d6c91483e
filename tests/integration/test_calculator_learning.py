"""Tool use is learned: the demo's calculator SFT on tool-call traces, then GRPO, held-out, asserted.

Its own file so that `make test` (whole files per xdist worker) runs it beside test_learning.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import example_config

from rollout.config import load_config

pytestmark = pytest.mark.slow


def _eval_metrics(capsys, model_dir, data, store_path, *extra: str) -> dict[str, float]:
    """`rollout eval` on the calculator env (tool calls parsed, run and answered): its metrics."""
    from rollout.cli.main import main

    args = ["eval", "--env", "calculator", "--data", str(data), "--model", str(model_dir), "--max-turns", "3",
            "--max-tokens", "48", "--json", "--storage-path", str(store_path), "--threads", "1", *extra]  # fmt: skip
    capsys.readouterr()
    try:
        main(args)
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["metrics"]


def _greedy(capsys, model_dir, data, store_path) -> dict[str, float]:
    return _eval_metrics(capsys, model_dir, data, store_path, "--temperature", "0")


def test_calculator_tool_use_is_learned_from_traces_then_by_grpo(workspace, sft_run, tmp_path, capsys):
    """The demo's tool-use chain: SFT on calculator traces, a cold start, GRPO; held-out, asserted.

    Held-out: 200 products no trace or RL prompt shows, greedy, up to 3 turns (a call, the tool's
    answer, the final answer). The arithmetic SFT model never saw a tool call: 0.0 on every seed.
    The tools SFT (examples/tools-sft-tiny.toml: the untrained tiny model, batch 32 x 2500 steps)
    measured 0.99 / 0.925 / 1.0 (seeds 0 / 1 / 2, 1 thread, a 2-core AMD EPYC VM); seed 0 with 2
    threads 0.935 at step 1500. The cold start (tools-cold-sft-tiny: 150 steps on traces of which
    80% answer without the tool) answers from its head greedily (0.0) and calls the tool in 11-25%
    of sampled episodes; GRPO (tools-grpo-tiny, 40 steps) has to learn that calling pays. From the
    earlier tools SFT (started from the arithmetic SFT model) the chains measured 0.0 -> 0.965 /
    - / 0.855 natively and - / 0.86 / 0.965 on AVX2 kernels; from this one 0.0 -> 0.865 / 0.825 / 0.795.
    Every greedy episode then calls the tool. Asserted: the issue's figures (SFT >= 0.60, GRPO >=
    +0.15 over its start)."""
    from rollout.algorithms.grpo import train_grpo
    from rollout.algorithms.sft import train_sft
    from rollout.tasks.calculator import write_calculator_data

    data = write_calculator_data(workspace / "data" / "calculator")["eval_prompts"]
    write_calculator_data(workspace / "data" / "calculator-cold", n_sft=2000, direct_share=0.8)
    sft_export = sft_run[0].algorithm.settings.export.dir
    store = tmp_path / "evals.db"
    without_tool = _greedy(capsys, sft_export, data, store)["pass@1"]  # never saw a tool call
    sft_cfg = load_config(example_config("tools-sft-tiny.toml", workspace, tmp_path / "sft"))
    assert str(sft_cfg.algorithm.settings.base_model.uri) == str(workspace / "models" / "tiny")
    train_sft(sft_cfg)
    sft_acc = _greedy(capsys, sft_cfg.algorithm.settings.export.dir, data, store)["pass@1"]
    cold_cfg = load_config(example_config("tools-cold-sft-tiny.toml", workspace, tmp_path / "cold"))
    assert str(cold_cfg.algorithm.settings.base_model.uri) == str(sft_cfg.algorithm.settings.export.dir)
    train_sft(cold_cfg)
    cold = _greedy(capsys, cold_cfg.algorithm.settings.export.dir, data, store)
    grpo_cfg = load_config(example_config("tools-grpo-tiny.toml", workspace, tmp_path / "grpo"))
    assert str(grpo_cfg.algorithm.settings.base_model.uri) == str(cold_cfg.algorithm.settings.export.dir)
    train_grpo(grpo_cfg)
    grpo = _greedy(capsys, grpo_cfg.algorithm.settings.export.dir, data, store)
    print(f"calculator pass@1: no tool traces {without_tool:.3f}, tools SFT {sft_acc:.3f}, cold start"
          f" {cold['pass@1']:.3f} ({cold['mean_tool_calls']:.2f} calls), GRPO {grpo['pass@1']:.3f}"
          f" ({grpo['mean_tool_calls']:.2f} calls)")
    assert without_tool <= 0.05
    assert sft_acc >= 0.60
    assert cold["mean_tool_calls"] <= 0.1  # greedy, the cold start answers from its head
    assert grpo["pass@1"] >= cold["pass@1"] + 0.15
    assert grpo["mean_tool_calls"] >= 0.9  # and what GRPO learned is to call the tool
