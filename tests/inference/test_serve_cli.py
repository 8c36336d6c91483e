"""`rollout serve` as a user runs it: a subprocess on a free port, answered by the `openai` client."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from rollout.errors import ConfigError
from rollout.inference.build import build_engine, resolve_engine_model
from rollout.inference.config import InferenceConfig
from rollout.inference.types import EngineUnavailable

ROLLOUT = Path(sys.executable).parent / "rollout"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)
    return env


def test_rollout_serve_subprocess(tiny_model_dir: Path) -> None:
    cmd = [str(ROLLOUT), "serve", "--model", str(tiny_model_dir), "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(ROLLOUT_API_KEY="env-key")
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(
            r"serving (\S+) on (http://127\.0\.0\.1:\d+/v1) \(api key on, weight updates off\)", line
        )
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=match.group(2), api_key="env-key", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert 1 <= reply.usage.completion_tokens <= 4 and reply.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully, then re-raises the signal
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_port_in_use_exits_2_before_loading(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [str(ROLLOUT), "serve", "--model", str(tiny_model_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
    assert r.returncode == 2 and r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}"), r.stderr


def test_engine_choices_fail_clearly(tmp_path: Path, tiny_model_dir: Path) -> None:
    where = dict(storage_path=tmp_path / "rollout.db", object_path=tmp_path / "objects")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(EngineUnavailable, match="vLLM"):
            cfg = InferenceConfig(engine="vllm")
            build_engine(cfg, resolve_engine_model(cfg, model=str(tiny_model_dir), **where))
    with pytest.raises(ConfigError, match="base_url"):
        resolve_engine_model(InferenceConfig(engine="openai"), model="tiny", **where)
    with pytest.raises(ConfigError, match="no model"):
        resolve_engine_model(InferenceConfig(), model=None, **where)
