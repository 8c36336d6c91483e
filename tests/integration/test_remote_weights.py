"""GRPO sampling from a running `rollout serve` (a subprocess) and pushing its weights there after every step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from integration_helpers import example_config

from rollout.config import load_config
from rollout.store import open_store

ROLLOUT = Path(sys.executable).parent / "rollout"
ADMIN = "admin-secret"
N = 3


@pytest.fixture
def remote(workspace):
    yield from _serve(workspace)


def _serve(workspace):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    cmd = [str(ROLLOUT), "serve", "--model", str(workspace / "models" / "tiny"), "--port", "0", "--threads", "1",
           "--admin-key", ADMIN, "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"on (http://127\.0\.0\.1:\d+/v1) \(api key off, weight updates on\)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _health(base_url: str) -> dict:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10) as r:
        return json.loads(r.read())


def _greedy_logprobs(base_url: str, prompt: str) -> list[float]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["logprobs"]["token_logprobs"]


def test_grpo_samples_from_and_pushes_weights_to_a_remote_server(remote, workspace, tmp_path):
    from rollout.algorithms.grpo import train_grpo
    from rollout.inference.hf_engine import load_hf_engine
    from rollout.inference.types import SamplingParams

    text = example_config("grpo-tiny.toml", workspace, tmp_path, {
        '"../local/models/sft-warmup"': '"../local/models/tiny"',
        "minibatch_size = 16": "minibatch_size = 2", "num_generations = 8": "num_generations = 4",
        "max_tokens = 6": "max_tokens = 4", "max_steps = 250": f"max_steps = {N}",
        "dynamic_sampling = true": "dynamic_sampling = false", "lr = 1e-3": "lr = 1e-2",
        'name = "arithmetic_correct"': 'name = "rl_plugins:text_length"',
    }).read_text()
    config = tmp_path / "remote.toml"
    config.write_text(text + f'\n[inference]\nengine = "openai"\nbase_url = "{remote}"\nmodel = "tiny"\n'
                             f'admin_key = "{ADMIN}"\n')
    cfg = load_config(config)
    prompt = "What is 3+4?"
    before = _greedy_logprobs(remote, prompt)
    assert _health(remote)["weights_version"] == 0

    result = train_grpo(cfg)

    # one push before each step's sampling and one of the final policy
    assert _health(remote)["weights_version"] == N + 1
    store = open_store("embedded", path=cfg.storage.embedded.path)
    metrics = {(m.step, m.name): m.value for m in store.read_metrics(result.run_id)}
    store.close()
    assert all(metrics[(step, "rollout/samples")] == 8 for step in range(1, N + 1))
    # the server now answers exactly as the exported policy does, and no longer as the base model
    local = load_hf_engine(str(tmp_path / "grpo-export")).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0][0]
    after = _greedy_logprobs(remote, prompt)
    assert after == pytest.approx(list(local.logprobs), abs=1e-4)
    assert after != pytest.approx(before, abs=1e-4)
    # pushed folders do not pile up on disk: only the latest is kept
    assert len(list((cfg.storage.resolved_runs_dir() / result.run_id / "weights").iterdir())) <= 1


def _served_requests(base_url: str) -> float:
    """Generation requests answered 200, from the server's Prometheus counters."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rollout_requests_total{") and 'status="200"' in line and "completions" in line)


def test_grpo_samples_from_a_pool_of_servers_and_pushes_weights_to_each(workspace, tmp_path):
    """`base_urls = [a, b]`: both servers take requests (pulled by whichever is free) and both load
    every version of the weights."""
    from rollout.algorithms.grpo import train_grpo

    servers = [_serve(workspace), _serve(workspace)]
    urls = [next(s) for s in servers]
    try:
        text = example_config("grpo-tiny.toml", workspace, tmp_path, {
            '"../local/models/sft-warmup"': '"../local/models/tiny"',
            "minibatch_size = 16": "minibatch_size = 4", "num_generations = 8": "num_generations = 2",
            "max_tokens = 6": "max_tokens = 4", "max_steps = 250": f"max_steps = {N}",
            "dynamic_sampling = true": "dynamic_sampling = false",
        }).read_text()
        config = tmp_path / "pool.toml"
        config.write_text(text + f'\n[inference]\nengine = "openai"\nbase_urls = {json.dumps(urls)}\nmodel = "tiny"\n'
                                 f'admin_key = "{ADMIN}"\nmax_concurrency = 2\n')
        result = train_grpo(load_config(config))
        assert result.steps == N
        assert [_health(u)["weights_version"] for u in urls] == [N + 1, N + 1]
        served = [_served_requests(u) for u in urls]
        assert all(n > 0 for n in served) and sum(served) >= 4 * N, served  # 4 prompts a step (n = 2 each)
    finally:
        for s in servers:
            s.close()
