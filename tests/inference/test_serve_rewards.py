"""A reward model over HTTP: `rollout serve --model <RM export>` (POST /v1/rewards) as a user runs it,
answered by a real HTTP client and by `ServedRewardModel`; and the client against deliberately faulty peers."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROLLOUT = Path(sys.executable).parent / "rollout"
KEY = "rm-key"
CHAT = [{"role": "user", "content": "What is 3+4?"}]
PROMPTS = [CHAT, CHAT, "What is 1+1? ", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "9+9?"}]]
COMPLETIONS = ["7", " 8 and more", "2", "18"]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward-model folder shaped like an RM export: the tiny model with a fresh 1-logit head."""
    from rollout.export import export_model_dir
    from rollout.models.load import ModelSource, load_model, load_tokenizer

    source = ModelSource(str(tiny_model_dir))
    tokenizer = load_tokenizer(source)
    model = load_model(source, task="reward", pad_token_id=tokenizer.pad_token_id, seed=3)
    return export_model_dir(model, tokenizer, tmp_path_factory.mktemp("served-rm") / "rm-tiny")


@pytest.fixture(scope="module")
def server(rm_dir: Path) -> Iterator[str]:
    """`rollout serve --model <rm>` on a free port with a key; its /v1 base URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ROLLOUT_API_KEY=KEY)
    proc = subprocess.Popen([str(ROLLOUT), "serve", "--model", str(rm_dir), "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"serving reward model rm-tiny on (http://127\.0\.0\.1:\d+/v1) \(POST /v1/rewards; api key on\)",
                          line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def _in_process(rm_dir: Path, **kwargs):
    import torch

    from rollout.rl.reward_model import load_reward_model

    return load_reward_model(rm_dir, device=torch.device("cpu"), **kwargs)


def _post(url: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/rewards", json=body, headers=headers, timeout=60)


def test_served_scores_are_the_in_process_scores(server: str, rm_dir: Path) -> None:
    items = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    answer = _post(server, {"model": "rm-tiny", "items": items})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["model"] == "rm-tiny"
    rm = _in_process(rm_dir)
    expected = rm.score(PROMPTS, COMPLETIONS)
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 4  # a fresh head still tells the texts apart
    assert body["usage"]["prompt_tokens"] == sum(len(s.input_ids) for s in rm.tokenize(PROMPTS, COMPLETIONS))
    models = httpx.get(f"{server}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert models["data"][0]["id"] == "rm-tiny" and models["data"][0]["kind"] == "reward_model"


@pytest.mark.parametrize(("body", "key", "status", "message"), [
    ({"items": [{"prompt": "a", "completion": "b"}]}, None, 401, "API key"),
    ({"items": [{"prompt": "a", "completion": "b"}]}, "wrong", 401, "API key"),
    ({"items": []}, KEY, 400, "items"),
    ({"items": [{"prompt": "a", "completion": 7}]}, KEY, 400, "items.0.completion"),
    ({"items": [{"prompt": [{"role": "wizard", "content": "x"}], "completion": "b"}]}, KEY, 400, "items.0.prompt"),
    ({"items": [{"prompt": "a", "completion": "b", "extra": 1}]}, KEY, 400, "items.0.extra"),
    ({"items": [{"prompt": "", "completion": ""}]}, KEY, 400, "single token"),
    ({"model": "other", "items": [{"prompt": "a", "completion": "b"}]}, KEY, 404, "'other' is not served"),
    ({"items": [{"prompt": "a", "completion": "b"}] * 1025}, KEY, 413, "at most 1024"),
    ("not an object", KEY, 400, "JSON object"),
])
def test_bad_requests_get_one_clear_4xx(server: str, body: object, key: str | None, status: int, message: str) -> None:
    answer = _post(server, body, key)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]["message"]


def test_a_reward_server_does_not_generate(server: str) -> None:
    answer = httpx.post(f"{server}/chat/completions", json={"model": "rm-tiny", "messages": CHAT},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.status_code == 404


def test_served_reward_model_scores_and_normalises_like_the_in_process_one(server: str, rm_dir: Path) -> None:
    from rollout.rl.served_reward import RewardServerError, ServedRewardModel

    served = ServedRewardModel(server, api_key=KEY, batch_size=3, normalize="group")  # 2 requests of 3 + 1... items
    assert served.check() == "rm-tiny"
    local = _in_process(rm_dir, normalize="group")
    prompts, completions = PROMPTS * 2, COMPLETIONS + ["6", "3", "1", "19"]
    assert served.raw(prompts, completions) == pytest.approx(local.raw(prompts, completions), abs=1e-5)
    assert served(prompts, completions) == pytest.approx(local(prompts, completions), abs=1e-5)
    with pytest.raises(RewardServerError, match="HTTP 401"):
        ServedRewardModel(server, api_key="wrong", max_retries=0).check()
    with pytest.raises(RewardServerError, match="serves 'rm-tiny', not 'other'"):
        ServedRewardModel(server, api_key=KEY, model_name="other").check()


def test_a_served_entry_fails_before_training_when_its_server_cannot_be_used(server: str, monkeypatch) -> None:
    from rollout.algorithms.config import RewardModelSpec
    from rollout.algorithms.rl_common import served_reward_model
    from rollout.errors import ConfigError

    entry = RewardModelSpec(kind="reward_model", url=server, api_key_env="RM_TEST_KEY", max_retries=0)
    monkeypatch.delenv("RM_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"\$RM_TEST_KEY, which is not set"):
        served_reward_model(entry)
    monkeypatch.setenv("RM_TEST_KEY", "wrong")
    with pytest.raises(ConfigError, match="HTTP 401"):
        served_reward_model(entry)
    monkeypatch.setenv("RM_TEST_KEY", KEY)
    assert served_reward_model(entry).score(["What is 1+1? "], ["2"])
    with pytest.raises(ConfigError, match="cannot reach"):
        served_reward_model(RewardModelSpec(kind="reward_model", url="http://127.0.0.1:9/v1", max_retries=0))


def test_reward_model_entry_sources_and_url_options_are_checked() -> None:
    from pydantic import ValidationError

    from rollout.algorithms.config import RewardModelSpec

    served = RewardModelSpec(kind="reward_model", url="http://127.0.0.1:8001/v1")
    assert "url" in served.model_dump() and "api_key_env" not in served.model_dump()
    for bad, problem in [
        ({"url": "ftp://x/v1"}, "url"),
        ({"url": "http://127.0.0.1:1/v1", "snapshot": "0123abcd"}, "exactly one of model"),
        ({"snapshot": "0123abcd", "api_key_env": "K"}, "go with url"),
        ({"url": "http://127.0.0.1:1/v1", "api_key_env": "not a name"}, "api_key_env"),
    ]:
        with pytest.raises(ValidationError, match=problem):
            RewardModelSpec(kind="reward_model", **bad)


# --- the client against faulty peers ---------------------------------------------------


class _Faulty(http.server.BaseHTTPRequestHandler):
    """Answers POST /v1/rewards from the class's script: (status, body) per request, then the last one."""

    script: list[tuple[int, object]] = []
    seen = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        status, body = self.script[min(type(self).seen, len(self.script) - 1)]
        type(self).seen += 1
        if callable(body):
            body = body(len(items))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if status == 503:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def faulty() -> Iterator[type[_Faulty]]:
    handler = type("Handler", (_Faulty,), {"script": [], "seen": 0})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"  # type: ignore[attr-defined]
    yield handler
    httpd.shutdown()
    httpd.server_close()


def _scores(n: int) -> dict:
    return {"data": [{"index": i, "score": float(i) / 2} for i in reversed(range(n))]}


def test_busy_and_failing_servers_are_retried_then_reported(faulty) -> None:
    from rollout.rl.served_reward import RewardServerError, ServedRewardModel

    faulty.script = [(503, {"error": {"message": "busy"}}), (502, {}), (200, _scores)]
    rm = ServedRewardModel(faulty.url, max_retries=2, backoff_s=0.01)
    assert rm.score(["a", "b", "c"], ["x", "y", "z"]) == [0.0, 0.5, 1.0]  # in index order
    assert faulty.seen == 3
    faulty.script, faulty.seen = [(503, {"error": {"message": "busy"}})], 0
    with pytest.raises(RewardServerError, match="HTTP 503: busy"):
        ServedRewardModel(faulty.url, max_retries=1, backoff_s=0.01).score(["a"], ["x"])
    assert faulty.seen == 2
    faulty.script, faulty.seen = [(400, {"error": {"message": "items.0: bad"}})], 0
    with pytest.raises(RewardServerError, match="HTTP 400: items.0: bad"):
        ServedRewardModel(faulty.url, max_retries=3, backoff_s=0.01).score(["a"], ["x"])
    assert faulty.seen == 1  # a client error is not retried


@pytest.mark.parametrize(("body", "problem"), [
    (lambda n: {"data": [{"index": 0, "score": 1.0}]}, "1 scores for 2 items"),
    (lambda n: {"data": [{"index": 0, "score": 1.0}, {"index": 0, "score": 2.0}]}, "repeated index 0"),
    (lambda n: {"data": [{"index": 0, "score": 1.0}, {"index": 1, "score": "NaN"}]}, "no finite score"),
    (lambda n: {"data": [{"index": 0, "score": 1.0}, {"index": 1, "score": float("inf")}]}, "no finite score"),
    (lambda n: {"nothing": True}, "no scores for 2 items"),
])
def test_answers_that_are_not_one_finite_score_per_item_are_errors(faulty, body, problem) -> None:
    from rollout.rl.served_reward import RewardServerError, ServedRewardModel

    faulty.script = [(200, body)]
    with pytest.raises(RewardServerError, match=problem):
        ServedRewardModel(faulty.url, max_retries=0).score(["a", "b"], ["x", "y"])
