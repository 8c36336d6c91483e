"""`rollout serve` through the official `openai` client, unchanged, against a real server on a loopback port."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import openai
import pytest
import torch
from inference_helpers import LiveServer, start_server

from rollout.inference import SamplingParams
from rollout.inference.hf_engine import HFEngine
from rollout.inference.openai_engine import OpenAIEngine

KEY = "test-key"
CHAT = [{"role": "user", "content": "What is 3+8?"}]


@pytest.fixture(scope="module")
def server(engine: HFEngine):
    live = start_server(engine, model_name="tiny", api_key=KEY, max_batch_size=8)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_with_n_logprobs_and_usage(client: openai.OpenAI, engine: HFEngine) -> None:
    r = client.completions.create(
        model="tiny",
        prompt="What is 3+8?",
        max_tokens=6,
        n=3,
        seed=5,
        logprobs=2,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(engine.tokenize("What is 3+8?"))
    assert r.usage.completion_tokens == 18 and r.usage.total_tokens == r.usage.prompt_tokens + 18
    direct = engine.generate(["What is 3+8?"], SamplingParams(max_tokens=6, n=3, seed=5, ignore_eos=True))[0]
    for choice, c in zip(r.choices, direct, strict=True):
        assert choice.text == c.text and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(list(c.logprobs), abs=1e-6)
        assert len(choice.logprobs.tokens) == 6
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_tempered_logprobs_extension(client: openai.OpenAI, engine: HFEngine) -> None:
    """`tempered_logprobs` (rollout's extension): log-probs of softmax(logits / T), as an RL trainer
    pooling remote engines needs; the same seed samples the same tokens."""
    common = dict(model="tiny", prompt="What is 3+8?", max_tokens=6, seed=5, logprobs=0, temperature=0.5)
    raw = client.completions.create(**common)
    tempered = client.completions.create(**common, extra_body={"tempered_logprobs": True})
    direct = engine.generate(["What is 3+8?"], SamplingParams(max_tokens=6, seed=5, temperature=0.5,
                                                              tempered_logprobs=True))[0][0]
    assert tempered.choices[0].text == raw.choices[0].text == direct.text
    assert tempered.choices[0].logprobs.token_logprobs == pytest.approx(list(direct.logprobs), abs=1e-6)
    assert raw.choices[0].logprobs.token_logprobs != pytest.approx(list(direct.logprobs), abs=1e-3)
    bad = httpx.post(f"{client.base_url}completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={**common, "tempered_logprobs": "yes"}, timeout=30)
    assert bad.status_code == 400


def test_completion_with_several_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["hello", "What is"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: the two choices of a prompt agree


def test_chat_completion_logprobs_are_exact(client: openai.OpenAI, engine: HFEngine) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=8,
        temperature=0.8,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    token_ids = choice.model_extra["token_ids"]
    prompt_ids = engine.tokenize(CHAT)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(token_ids)
    lps = [e.logprob for e in choice.logprobs.content]
    ids = torch.tensor([list(prompt_ids) + token_ids], device=engine.device)
    with torch.no_grad():
        ref = engine.model(input_ids=ids).logits[0].float().log_softmax(-1)
    expected = [ref[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(token_ids)]
    assert lps == pytest.approx(expected, abs=1e-4)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in choice.logprobs.content)


def test_same_seed_same_answer_through_the_api(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=12, n=2, seed=42, temperature=1.0
        )
        return [c.message.content for c in r.choices]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # batched with each other, and alone
        together = list(pool.map(lambda _: ask(), range(4)))
    assert all(t == together[0] for t in together) and together[0] == ask()


def test_chat_stream_matches_the_non_streamed_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=1.0, seed=8, n=2)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, logprobs=True
    )
    text = {0: "", 1: ""}
    reasons, usage, logprob_count = {}, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                logprob_count += len(c.logprobs.content or [])
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == logprob_count


def test_completion_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    parts = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(parts) == whole.choices[0].text


def test_stop_string(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model="tiny", prompt="hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[4:6]
    cut = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_concurrent_requests_share_forward_passes(client: openai.OpenAI, server: LiveServer) -> None:
    def ask(i: int) -> str:
        return (
            client.completions.create(
                model="tiny",
                prompt=f"What is {i}+1?",
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    before = _histogram(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(8)))
    after = _histogram(server)
    steps, rows = after[0] - before[0], after[1] - before[1]
    assert rows / steps > 1.5, (steps, rows)  # 8 requests x 16 tokens took well under 128 forward passes


def test_openai_engine_against_rollout_serve(server: LiveServer, engine: HFEngine) -> None:
    remote = OpenAIEngine(base_url=server.base_url, model_name="tiny", api_key=KEY)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2, n=2, top_logprobs=2)
    prompts = ["What is 3+8?", CHAT]
    got = remote.generate(prompts, params)
    want = engine.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
            assert a.prompt_token_ids == b.prompt_token_ids and a.prompt_tokens == b.prompt_tokens
    remote.close()


def _histogram(server: LiveServer) -> tuple[float, float]:
    text = httpx.get(f"{server.root}/metrics").text
    count = float(re.search(r"^rollout_batch_rows_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^rollout_batch_rows_sum (\S+)$", text, re.M).group(1))
    return count, total
