"""Same config + same seed => byte-identical weights, across fresh processes and store paths.

Each run is a separate `rollout train` process with its own store, object
store and export folder (so different run ids and paths); the exported
`model.safetensors` files must be equal byte for byte. What is *not* promised
(a different `torch.set_num_threads`, another CPU's kernels, CUDA) is listed in
the README's "Determinism" section.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from integration_helpers import example_config

CASES = {
    "sft": ("sft-tiny.toml", {
        "minibatch_size = 32": "minibatch_size = 8",
        "max_steps = 400": "max_steps = 12",
        "every_steps = 200": "every_steps = 6",
        "warmup_steps = 20": "warmup_steps = 2",
        '"../local/models/sft-tiny"': '"EXPORT"',
    }),
    "grpo": ("grpo-tiny.toml", {
        '"../local/models/sft-warmup"': '"../local/models/tiny"',
        "minibatch_size = 16": "minibatch_size = 3",
        "num_generations = 8": "num_generations = 4",
        "max_tokens = 6": "max_tokens = 4",
        "max_steps = 250": "max_steps = 4",
        "every_steps = 50": "every_steps = 2",
        '"../local/models/grpo-tiny"': '"EXPORT"',
    }),
}


def _train(kind: str, config) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "rollout.cli.main", "train", kind, "--config", str(config)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_fresh_runs_give_byte_identical_weights(case, workspace, tmp_path):
    name, replace = CASES[case]
    weights = []
    for i in range(2):
        dest = tmp_path / f"run{i}"
        export = dest / "export"
        config = example_config(name, workspace, dest, {**replace, '"EXPORT"': f'"{export}"'})
        _train(case, config)
        weights.append((export / "model.safetensors").read_bytes())
    base = (workspace / "models" / "tiny" / "model.safetensors").read_bytes()
    assert weights[0] != base  # training changed the weights
    assert weights[0] == weights[1]
