"""`rollout serve` under abuse: bad bodies, wrong keys, floods, disconnects, weight pushes."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from inference_helpers import LiveServer, start_server

from rollout.inference.hf_engine import HFEngine, load_hf_engine

KEY, ADMIN = "test-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(engine: HFEngine):
    live = start_server(
        engine,
        model_name="tiny",
        api_key=KEY,
        max_batch_size=8,
        max_body_bytes=MAX_BODY,
        max_tokens_limit=256,
        max_n=4,
        max_prompts=8,
    )
    yield live
    live.stop()


def _bad_requests() -> list[tuple[str, str, dict[str, str], bytes]]:
    """(method, path, headers, body): each must get a 4xx."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    text = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    wrong = {
        "model": [None, 1, [], {}, ""],
        "max_tokens": ["4", 4.5, True, -1, 0, 10**6, [4]],
        "temperature": ["hot", -0.5, 2.5, True, [1], {}],
        "top_p": [0, -1, 1.5, "1", False],
        "n": [0, -2, 1.5, "2", 99, True],
        "stop": [5, [1, 2], {"a": 1}, [""], ["x" * 300], ["a"] * 40],
        "seed": ["1", 1.5, 2**70, [1]],
        "stream": ["yes", 1, [], {}],
        "stream_options": [1, "x", {"include_usage": "yes"}],
        "top_k": [-5, "3", 2.5],
        "stop_token_ids": ["1", [-1], ["a"], 5],
        "ignore_eos": ["no", 2],
        "presence_penalty": [1.0, "x", 5.0],
        "frequency_penalty": [0.5, 9],
        "logit_bias": [{"5": 1.0}, "x", [1]],
        "user": [5, []],
    }
    chat_only = {
        "messages": [
            [],
            "hi",
            [{"role": "user"}],
            [{"role": "wizard", "content": "x"}],
            [{"content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            [{"role": "user", "content": "x" * 3000}],
            None,
            [None],
        ],
        "logprobs": ["true", 1, []],
        "top_logprobs": [-1, 21, "2", 5.5],
        "max_completion_tokens": [0, "5", 10**6],
        "tools": [
            "x",
            [5],
            [{"type": "retrieval"}],
            [{"type": "function", "function": {}}],
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        ],
        "tool_choice": ["required", 5, {"type": "function", "function": {"name": "f"}}],
        "response_format": [{"type": "json_object"}, "x"],
    }
    text_only = {
        "prompt": [
            None,
            5,
            [],
            [[]],
            {},
            [1.5],
            ["a", 1],
            [[-1]],
            [[10**9]],
            [5] * 600,
            "x" * 3000,
            ["a"] * 20,
        ],
        "logprobs": [-1, 21, "2", True],
        "echo": [True, "yes"],
        "suffix": ["x", 5],
        "best_of": [3, 0, "2"],
    }
    out: list[tuple[str, str, dict[str, str], bytes]] = []
    for path, base, extra in (
        ("/v1/chat/completions", chat, chat_only),
        ("/v1/completions", text, text_only),
    ):
        for field, values in {**wrong, **extra}.items():
            for value in values:
                out.append(("POST", path, AUTH, json.dumps({**base, field: value}).encode()))
        for raw in (b"", b"{", b"[]", b"null", b"123", b'"hi"', b"\xff\xfe\x00", b"[" * 100_000, b"{'a': 1}"):
            out.append(("POST", path, AUTH, raw))
        out.append(("POST", path, AUTH, json.dumps({**base, "model": "other-model"}).encode()))
        out.append(("POST", path, AUTH, json.dumps({k: v for k, v in base.items() if k != "model"}).encode()))
        out.append(("POST", path, AUTH, json.dumps({**base, "pad": "x" * (MAX_BODY + 1)}).encode()))  # 413
        out.append(("POST", path, AUTH, json.dumps({**base, "stream": True, "n": 0}).encode()))
        out.append(("POST", path, {}, json.dumps(base).encode()))  # no key
        out.append(("GET", path, AUTH, b""))  # wrong method
    out += [
        ("GET", "/v1/nope", AUTH, b""),
        ("POST", "/v1/models", AUTH, b"{}"),
        ("GET", "/nope", {}, b""),
        ("POST", "/update_weights_from_disk", AUTH, b'{"model_path": "/tmp"}'),
    ]
    return out


def test_malformed_requests_get_4xx_in_openai_shape(server: LiveServer) -> None:
    bad = _bad_requests()
    assert len(bad) >= 200
    with httpx.Client(base_url=server.root, timeout=30) as http:
        for method, path, headers, body in bad:
            r = http.request(method, path, headers=headers, content=body)
            assert 400 <= r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        ok = http.post(
            "/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "hi", "max_tokens": 3}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert http.get("/health").json()["status"] == "ok"
        metrics = http.get("/metrics").text
    assert re.search(r'rollout_requests_total\{endpoint="/v1/chat/completions",status="400"\} \d+', metrics)


def test_api_key(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=server.root, timeout=30) as http:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": KEY},
        ):
            r = http.post("/v1/chat/completions", headers=headers, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/models", headers=headers).status_code == 401
        assert http.post("/v1/chat/completions", headers=AUTH, json=body).status_code == 200
        assert http.get("/health").status_code == 200  # liveness needs no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


class _ThrottledSession:
    """A decode session that takes at least `delay_s` per step, so a request is surely still running
    when its client gives up, however fast the machine (the disconnect logic is what is under test)."""

    def __init__(self, inner, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s

    def step(self):
        time.sleep(self._delay_s)
        return self._inner.step()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _ThrottledEngine:
    def __init__(self, inner: HFEngine, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s

    def open_session(self) -> _ThrottledSession:
        return _ThrottledSession(self._inner.open_session(), self._delay_s)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_client_disconnect_frees_its_slot(engine: HFEngine) -> None:
    # 256 tokens at >= 20 ms a step: >= 5 s of work, against a client that waits 0.5 s
    live = start_server(_ThrottledEngine(engine, 0.02), model_name="tiny", api_key=KEY, max_batch_size=8)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 256, "stream": True, "ignore_eos": True}
    try:
        before = _metric(live, "rollout_cancelled_requests_total")
        with httpx.Client(base_url=live.root, timeout=30) as http:
            with http.stream("POST", "/v1/completions", headers=AUTH, json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # generation is under way
            # and once more without streaming: the client gives up after a moment
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", headers=AUTH, json={**body, "stream": False}, timeout=0.5)
            _wait_for(
                lambda: _metric(live, "rollout_cancelled_requests_total") >= before + 2,
                what="two cancellations",
            )
            _wait_for(lambda: http.get("/health").json()["active_rows"] == 0, what="no active rows")
    finally:
        live.stop()


def test_flooding_past_the_queue_gets_503_with_retry_after(engine: HFEngine) -> None:
    # >= 10 ms a step, so the queue surely fills however fast the machine
    live = start_server(
        _ThrottledEngine(engine, 0.01), model_name="tiny", max_batch_size=1, max_queue=2, gather_window_s=0
    )
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 24, "ignore_eos": True}
    try:
        with httpx.Client(base_url=live.root, timeout=60, limits=httpx.Limits(max_connections=32)) as http:
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                responses = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(24)))
            codes = sorted(r.status_code for r in responses)
            assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
            for r in responses:
                if r.status_code == 503:
                    assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
            assert http.post("/v1/completions", json=body).status_code == 200  # still serving
    finally:
        live.stop()


def test_update_weights_from_disk(tiny_model_dir: Path, other_weights_dir: Path) -> None:
    own = load_hf_engine(tiny_model_dir, model_name="tiny")  # its weights change: not the shared engine
    live = start_server(own, model_name="tiny", api_key=KEY, admin_key=ADMIN)
    body = {"model": "tiny", "prompt": "What is 3+8?", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        with httpx.Client(base_url=live.root, timeout=60) as http:
            before = http.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
            push = {"model_path": str(other_weights_dir)}
            for headers in ({}, AUTH, {"Authorization": "Bearer nope"}):
                assert http.post("/update_weights_from_disk", headers=headers, json=push).status_code == 401
            assert (
                http.post(
                    "/update_weights_from_disk", headers=admin, json={"model_path": "/no/such"}
                ).status_code
                == 400
            )
            r = http.post("/update_weights_from_disk", headers=admin, json=push)
            assert r.status_code == 200 and r.json()["success"] is True and r.json()["weights_version"] == 1
            after = http.post("/v1/completions", headers=AUTH, json=body).json()
            assert after["choices"][0]["text"] != before and after["system_fingerprint"] == "rollout-w1"
            assert http.get("/health").json()["weights_version"] == 1
    finally:
        live.stop()
    no_admin = start_server(own, model_name="tiny")
    try:
        r = httpx.post(
            f"{no_admin.root}/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir)},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 403 and own.weights_version == 1
    finally:
        no_admin.stop()


def _metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.root}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_for(condition, *, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
