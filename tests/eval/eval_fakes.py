"""Test doubles for the eval tests: engines, envs and a faulty OpenAI-compatible endpoint.

`HashEnv` is also loaded by `rollout eval` subprocesses as `eval_fakes:HashEnv` (PYTHONPATH=tests/eval).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollout.inference.types import Completion, GenerationError, PromptLike, SamplingParams, as_request
from rollout.rl.envs import prompt_messages
from rollout.rl.types import StepResult


class SeedEchoEngine:
    """Answers every request with `str(seed % 5)`: a deterministic function of the sample's seed.

    Records the size of every `generate` call; a prompt whose text contains "poison" makes the
    whole call fail (like an hf batch holding a too-long prompt).
    """

    model_name = "seed-echo"
    weights_version = 0

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def generate(self, requests: Sequence[PromptLike], params: SamplingParams | None = None) -> list[tuple]:
        reqs = [as_request(r) for r in requests]
        with self._lock:
            self.batch_sizes.append(len(reqs))
        if any("poison" in json.dumps(r.prompt) for r in reqs):
            raise GenerationError("the prompt is poisoned")
        out = []
        for r in reqs:
            p = r.params or params
            assert p is not None and p.seed is not None and p.n == 1
            out.append((Completion(0, str(p.seed % 5), (7,), (-0.5,), "stop", 3, 1),))
        return out

    def update_weights(self, weights: Any) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SeedAnswerEnv:
    """Single-turn: reward 1 when the completion equals row["answer"], 0.5 for "4", else 0."""

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.answer = str(row["answer"])
        return prompt_messages(row["prompt"])

    async def step(self, assistant_message: Mapping[str, str]) -> StepResult:
        text = assistant_message["content"]
        reward = 1.0 if text == self.answer else 0.5 if text == "4" else 0.0
        return StepResult((), reward, True, {"extracted": text})


class CountdownEnv:
    """Multi-turn: done after row["steps"] assistant turns; 0.25 reward per turn; a tool message each turn."""

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        self.left = int(row["steps"])
        return [{"role": "system", "content": "count down"}, *prompt_messages(row["prompt"])]

    async def step(self, assistant_message: Mapping[str, str]) -> StepResult:
        self.left -= 1
        if self.left <= 0:
            return StepResult((), 0.25, True, {"extracted": assistant_message["content"]})
        messages = ({"role": "tool", "content": f"{self.left} left"}, {"role": "user", "content": "again"})
        return StepResult(messages, 0.25, False, {})


class HashEnv:
    """Reward 0, 0.5 or 1 from a hash of the completion text; the answer too. Deterministic per text.

    With $EVAL_TEST_ENV_SLEEP_S set, every step sleeps that long first (to kill an eval mid-way).
    """

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        return prompt_messages(row["prompt"])

    async def step(self, assistant_message: Mapping[str, str]) -> StepResult:
        delay = float(os.environ.get("EVAL_TEST_ENV_SLEEP_S") or 0)
        if delay:
            await asyncio.sleep(delay)
        digest = hashlib.blake2b(assistant_message["content"].encode()).digest()
        return StepResult((), (digest[0] % 3) / 2, True, {"extracted": str(digest[1] % 3)})


# --------------------------------------------------------------------------- a faulty endpoint


class FaultyEndpoint:
    """An OpenAI-compatible chat endpoint (a local thread) that misbehaves on purpose, by prompt text.

    - "always-500": HTTP 500 every time;
    - "flaky": HTTP 503 on the first two tries of each (prompt, seed), then an answer;
    - "slow": the first try of each (prompt, seed) sleeps `slow_s` (longer than the client's timeout);
    - anything else: answers at once. The answer is "ok <seed % 3>".
    `tries[(prompt text, seed)]` counts the requests seen.
    """

    def __init__(self, *, slow_s: float = 1.0) -> None:
        self.slow_s = slow_s
        self.tries: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][-1]["content"]
                seed = int(body.get("seed") or 0)
                with endpoint._lock:
                    endpoint.tries[(text, seed)] += 1
                    tries = endpoint.tries[(text, seed)]
                if "always-500" in text:
                    return self._send(500, {"error": {"message": "boom", "type": "server_error"}})
                if "flaky" in text and tries <= 2:
                    return self._send(503, {"error": {"message": "busy", "type": "server_error"}})
                if "slow" in text and tries == 1:
                    time.sleep(endpoint.slow_s)
                self._send(200, _chat_response(f"ok {seed % 3}", body.get("model", "stub")))

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

        return Handler


def _chat_response(text: str, model: str) -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }
