"""Guess-the-number is learned: binary-search SFT, a cold start that strays, GRPO; held-out, asserted.

Its own file so that `make test` (whole files per xdist worker) runs it beside the other long ones.
"""

from __future__ import annotations

import pytest
from integration_helpers import eval_metrics, example_config

from rollout.config import load_config

pytestmark = pytest.mark.slow


def _success(capsys, model_dir, data, store_path, *extra: str) -> dict[str, float]:
    """Held-out guess_number games, at most 4 guesses."""
    return eval_metrics(capsys, "guess_number", model_dir, data, store_path, "--max-turns", "4", "--max-tokens", "8",
                        "--seed", "0", *extra)  # fmt: skip


def test_guess_number_search_is_learned_then_sharpened_by_grpo(workspace, tmp_path, capsys):
    """examples/guess-sft-tiny.toml -> guess-cold-sft-tiny.toml -> guess-grpo-tiny.toml, seed 0.

    Held-out: 200 games (n = 16, secrets from the eval stream), at most 4 guesses (binary search
    finds 15 of 16 secrets, a random search among the numbers still possible 58%). Measured on a
    2-core AMD EPYC VM, 1 thread (README, Agents): the binary-search SFT 0.96 greedy; the cold
    start (100 steps on half-middle, half-random traces) 0.80 greedy but 0.42 sampled; GRPO
    (progress reward, lr 6e-4) to 0.90 sampled on seed 0; with inverse-CDF sampling (2026-11-28)
    0.39 -> 0.64 on seed 0, +0.215 to +0.385 over seeds 0-4; on an Intel Xeon VM with AVX-512
    (2026-11-29) +0.135 on seed 0 (0.40 -> 0.535), +0.135 to +0.374 over seeds 0-4. Asserted: the
    SFT learned the search (greedy >= 0.8), the cold start strays when sampled (<= 0.6) and GRPO
    raises sampled held-out success by >= +0.08, 0.055 under the worst cell (it asserted +0.15,
    which that VM's seed 0 missed: a threshold set by the AMD VMs' cells; a GRPO run that does not
    learn gains ~+0.04, the sampled figure's noise is ~0.02)."""
    from rollout.algorithms.grpo import train_grpo
    from rollout.algorithms.sft import train_sft
    from rollout.tasks.guess_number import write_guess_number_data

    data = write_guess_number_data(workspace / "data" / "guess")["eval_prompts"]
    write_guess_number_data(workspace / "data" / "guess-mixed", strategy="mixed")
    store = tmp_path / "evals.db"
    sampled = ("--temperature", "1", "--n", "4")

    sft_cfg = load_config(example_config("guess-sft-tiny.toml", workspace, tmp_path / "sft"))
    assert str(sft_cfg.algorithm.settings.base_model.uri) == str(workspace / "models" / "tiny")
    train_sft(sft_cfg)
    sft = _success(capsys, sft_cfg.algorithm.settings.export.dir, data, store, "--temperature", "0")
    cold_cfg = load_config(example_config("guess-cold-sft-tiny.toml", workspace, tmp_path / "cold"))
    assert str(cold_cfg.algorithm.settings.base_model.uri) == str(sft_cfg.algorithm.settings.export.dir)
    train_sft(cold_cfg)
    cold = _success(capsys, cold_cfg.algorithm.settings.export.dir, data, store, *sampled)
    grpo_cfg = load_config(example_config("guess-grpo-tiny.toml", workspace, tmp_path / "grpo"))
    assert str(grpo_cfg.algorithm.settings.base_model.uri) == str(cold_cfg.algorithm.settings.export.dir)
    train_grpo(grpo_cfg)
    grpo = _success(capsys, grpo_cfg.algorithm.settings.export.dir, data, store, *sampled)
    print(f"guess_number success: binary-search SFT {sft['pass@1']:.3f} greedy; sampled: cold start"
          f" {cold['pass@1']:.3f} ({cold['mean_turns']:.2f} turns), GRPO {grpo['pass@1']:.3f}"
          f" ({grpo['mean_turns']:.2f} turns)")
    assert sft["pass@1"] >= 0.8
    assert cold["pass@1"] <= 0.6
    assert grpo["pass@1"] >= cold["pass@1"] + 0.08
