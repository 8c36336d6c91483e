"""A pool of servers as one engine (`base_urls`): two real `rollout serve` processes, one of them killed
mid-way; and the pool's rules against deliberately faulty engines (our own stubs, to play a peer that fails)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.inference.engine_pool import EnginePool
from rollout.inference.types import (
    Completion,
    EngineUnreachable,
    GenerationError,
    SamplingParams,
)

ROLLOUT = Path(sys.executable).parent / "rollout"
ADMIN = "admin-key"


def _start(model: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([str(ROLLOUT), "serve", "--model", str(model), "--port", "0", "--threads", "1",
                             "--admin-key", ADMIN, "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    match = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
    return proc, match.group(1)


@pytest.fixture
def two_servers(tiny_model_dir: Path) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    servers = [_start(tiny_model_dir), _start(tiny_model_dir)]
    yield servers
    for proc, _ in servers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def _pool(urls: list[str], **kwargs):
    from rollout.inference.build import build_engine, resolve_engine_model
    from rollout.inference.config import InferenceConfig

    cfg = InferenceConfig(engine="openai", base_urls=urls, admin_key=ADMIN, max_concurrency=2, **kwargs)
    return build_engine(cfg, resolve_engine_model(cfg, model="tiny", storage_path=Path("x"), object_path=Path("y")))


PROMPTS = [[{"role": "user", "content": f"What is {i}+{i + 1}?"}] for i in range(12)]


def test_a_pool_spreads_requests_and_survives_a_killed_server(two_servers, tiny_model_dir: Path) -> None:
    (proc_a, url_a), (_, url_b) = two_servers
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=11, n=2)
    from rollout.inference.openai_engine import OpenAIEngine

    alone = OpenAIEngine(base_url=url_b, model_name="tiny", max_retries=0)
    expected = [[c.token_ids for c in cs] for cs in alone.generate(PROMPTS, params)]
    alone.close()
    pool = _pool([url_a, url_b])
    try:
        first = pool.generate(PROMPTS, params)
        assert [[c.token_ids for c in cs] for cs in first] == expected  # seeded: the server does not matter
        stats = pool.stats()
        assert stats[url_a]["served"] > 0 and stats[url_b]["served"] > 0
        assert stats[url_a]["served"] + stats[url_b]["served"] == len(PROMPTS)
        proc_a.kill()
        proc_a.wait(timeout=30)
        second = pool.generate(PROMPTS, params)  # a's requests fail, go back to the queue, b takes them
        assert [[c.token_ids for c in cs] for cs in second] == expected
        assert pool.stats()[url_a]["failures"] >= 1
        assert pool.update_weights(str(tiny_model_dir)) == 1  # the same weights again: b loads them, a is gone
        assert pool.stats()[url_a]["out"] is not None and pool.stats()[url_b]["out"] is None
        assert len(pool.generate(PROMPTS[:3], params)) == 3  # only b is asked now
    finally:
        pool.close()


def test_base_urls_are_checked() -> None:
    from pydantic import ValidationError

    from rollout.inference.config import InferenceConfig

    for bad, problem in [
        ({"base_urls": []}, "at least 1"),
        ({"base_urls": ["ftp://a/v1"]}, "not an http"),
        ({"base_urls": ["http://a/v1", "http://a/v1/"]}, "repeated URL"),
        ({"base_urls": ["http://a/v1"], "base_url": "http://b/v1"}, "not both"),
    ]:
        with pytest.raises(ValidationError, match=problem):
            InferenceConfig(engine="openai", **bad)


# --- the pool's rules, against stub engines ----------------------------------------------


class _Stub:
    """An engine that answers after `delay` s, or fails as told: `fail` = "unreachable" | "refuse"."""

    model_name = "stub"

    def __init__(self, name: str, *, delay: float = 0.0, fail: str | None = None, fail_times: int = 10**9,
                 load_fails: bool = False) -> None:
        self.name, self.delay, self.fail, self.fail_times, self.load_fails = name, delay, fail, fail_times, load_fails
        self.calls = 0
        self.loaded = 0
        self.lock = threading.Lock()

    @property
    def weights_version(self) -> int:
        return self.loaded

    def generate(self, requests, params=None):
        with self.lock:
            self.calls += 1
            failing = self.fail is not None and self.calls <= self.fail_times
        time.sleep(self.delay)
        if failing and self.fail == "unreachable":
            raise EngineUnreachable(f"{self.name}: connection refused")
        if failing:
            raise GenerationError(f"{self.name}: HTTP 400 prompt too long")
        return [(Completion(index=0, text=f"{self.name}:{r.prompt}", token_ids=(1,), logprobs=(0.0,),
                            finish_reason="stop", prompt_tokens=1, completion_tokens=1),) for r in requests]

    def update_weights(self, weights):
        if self.load_fails:
            raise GenerationError(f"{self.name}: cannot read {weights}")
        self.loaded += 1
        return self.loaded

    def close(self) -> None:
        pass


def _stub_pool(*engines: _Stub, **kwargs) -> EnginePool:
    return EnginePool(list(engines), names=[e.name for e in engines], concurrency=2, cooldown_s=0.05, **kwargs)


def test_a_fast_engine_pulls_more_than_a_slow_one() -> None:
    fast, slow = _Stub("fast", delay=0.005), _Stub("slow", delay=0.06)
    out = _stub_pool(fast, slow).generate([f"p{i}" for i in range(40)])
    assert [cs[0].text.split(":")[1] for cs in out] == [f"p{i}" for i in range(40)]  # in request order
    assert fast.calls > 3 * slow.calls > 0


def test_unreachable_engines_are_rested_and_their_requests_requeued() -> None:
    flaky, good = _Stub("flaky", fail="unreachable", fail_times=2), _Stub("good", delay=0.01)
    events: list[tuple[str, dict]] = []
    pool = _stub_pool(flaky, good, on_event=lambda n, f: events.append((n, f)))
    out = pool.generate([f"p{i}" for i in range(10)])
    assert [cs[0].text.split(":")[1] for cs in out] == [f"p{i}" for i in range(10)]  # every request, once
    failures = pool.stats()["flaky"]["failures"]  # 1 or 2: the second only if flaky woke before good was done
    assert 1 <= failures <= 2 and flaky.calls - failures == pool.stats()["flaky"]["served"]
    assert [n for n, _ in events] == ["engine_unreachable"] * failures and events[0][1]["engine"] == "flaky"
    dead = _stub_pool(_Stub("a", fail="unreachable"), _Stub("b", fail="unreachable"), max_attempts=3)
    with pytest.raises(GenerationError, match="failed on 3 attempts"):
        dead.generate(["p"])


def test_a_refused_request_fails_the_batch_at_once() -> None:
    refusing, good = _Stub("refusing", fail="refuse"), _Stub("good", delay=0.02)
    with pytest.raises(GenerationError, match="HTTP 400 prompt too long"):
        _stub_pool(refusing, good).generate([f"p{i}" for i in range(6)])
    assert refusing.calls <= 2  # not retried elsewhere or again


def test_an_engine_that_cannot_load_weights_leaves_the_pool() -> None:
    ok, broken = _Stub("ok"), _Stub("broken", load_fails=True)
    events: list[tuple[str, dict]] = []
    pool = _stub_pool(ok, broken, on_event=lambda n, f: events.append((n, f)))
    assert pool.update_weights("v1") == 1 and pool.weights_version == 1
    assert pool.stats()["broken"]["out"].startswith("could not load weights version 1")
    assert events[0][0] == "engine_left_pool"
    broken.calls = 0
    pool.generate([f"p{i}" for i in range(6)])
    assert broken.calls == 0 and ok.loaded == 1  # it never samples with old weights
    with pytest.raises(GenerationError, match="no engine of the pool loaded"):
        _stub_pool(_Stub("x", load_fails=True)).update_weights("v1")
