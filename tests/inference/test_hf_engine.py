"""The hf engine: exact log-probs, seeds, stops, streaming, continuous batching, weight updates."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollout.errors import ConfigError, ModelError
from rollout.inference import GenerationError, GenerationRequest, SamplingParams, TokenEvent
from rollout.inference.hf_engine import HFEngine, load_hf_engine

PROMPTS = [
    "What is 3+8?",
    "The model learns the question carefully and then the teacher answers",
    "a",
    [{"role": "user", "content": "What is 1+2?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hi"}],
]


MAX_TOKENS = [
    3,
    12,
    5,
    10,
    7,
]  # unequal lengths: rows leave at different steps and queued ones join mid-flight


def varied(params: SamplingParams) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt=p, params=replace(params, max_tokens=m))
        for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def teacher_forced_logprobs(model, prompt_ids, token_ids, temperature: float = 1.0) -> torch.Tensor:
    """log p(token_i | prompt, tokens_<i) from one unpadded forward pass over prompt + completion,
    under softmax(logits / temperature)."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=model.device)
    with torch.no_grad():
        logprobs = (model(input_ids=ids).logits[0].float().cpu() / temperature).log_softmax(-1)
    start = len(prompt_ids) - 1
    return (
        logprobs[start : start + len(token_ids)].gather(-1, torch.tensor(token_ids).unsqueeze(-1)).squeeze(-1)
    )


@pytest.fixture(scope="module")
def small_batch_engine(tiny_model_dir: Path) -> HFEngine:
    """max_batch_size 3: most requests join a running batch (KV caches merged with left padding)."""
    return load_hf_engine(tiny_model_dir, max_batch_size=3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_tokens=12, seed=3),
    ],
    ids=["greedy", "sampled-n2", "temperature-topk-topp"],
)
def test_logprobs_equal_a_teacher_forced_forward_pass(
    small_batch_engine: HFEngine, params: SamplingParams
) -> None:
    results = small_batch_engine.generate(varied(params))
    assert len(results) == len(PROMPTS)
    for choices in results:
        assert len(choices) == params.n
        for c in choices:
            assert len(c.token_ids) == len(c.logprobs) == c.completion_tokens >= 1
            expected = teacher_forced_logprobs(small_batch_engine.model, c.prompt_token_ids, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_tempered_logprobs_are_of_the_temperature_scaled_distribution(small_batch_engine: HFEngine) -> None:
    """RL trains softmax(logits / T) (as TRL and verl do); the engine's log-probs must be of the same
    distribution for the importance ratio. Same seed: same tokens, only the log-probs change; rows
    with and without the flag (and greedy rows) share a batch."""
    tempered = SamplingParams(temperature=0.6, max_tokens=12, seed=3, tempered_logprobs=True)
    requests = varied(tempered)
    requests[1] = replace(requests[1], params=replace(tempered, tempered_logprobs=False))
    requests[2] = replace(requests[2], params=replace(tempered, temperature=0.0))
    results = small_batch_engine.generate(requests)
    plain = small_batch_engine.generate(varied(replace(tempered, tempered_logprobs=False)))
    for i, ([c], [p]) in enumerate(zip(results, plain, strict=True)):
        t = 0.6 if i != 1 and i != 2 else 1.0
        expected = teacher_forced_logprobs(small_batch_engine.model, c.prompt_token_ids, c.token_ids, t)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        if i not in (1, 2):
            assert c.token_ids == p.token_ids
            assert max(abs(a - b) for a, b in zip(c.logprobs, p.logprobs, strict=True)) > 1e-3


def test_same_seed_same_completion_batched_or_alone(engine: HFEngine, small_batch_engine: HFEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=11, n=2, ignore_eos=True)
    batched = engine.generate(varied(params))
    joined = small_batch_engine.generate(varied(params))  # the same requests, joining a running batch
    for request, together, merged in zip(varied(params), batched, joined, strict=True):
        alone = engine.generate([request])[0]
        assert (
            [c.token_ids for c in alone] == [c.token_ids for c in together] == [c.token_ids for c in merged]
        )
        assert [c.text for c in alone] == [c.text for c in together]
    again = engine.generate(varied(params))
    assert [[c.token_ids for c in cs] for cs in again] == [[c.token_ids for c in cs] for cs in batched]


def test_choices_and_seeds_differ(engine: HFEngine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=1)
    [choices] = engine.generate(["What is 3+8?"], params)
    assert len({c.token_ids for c in choices}) == 3
    [other] = engine.generate(["What is 3+8?"], SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=2))
    assert [c.token_ids for c in choices] != [c.token_ids for c in other]


def test_top_k_1_and_tiny_top_p_are_greedy(engine: HFEngine) -> None:
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, seed=5),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, seed=5),
    ):
        sampled = engine.generate(PROMPTS, params)
        assert [cs[0].token_ids for cs in sampled] == [cs[0].token_ids for cs in greedy]


def test_max_tokens_stop_strings_and_stop_tokens(engine: HFEngine) -> None:
    base = SamplingParams(temperature=1.0, max_tokens=24, seed=4, ignore_eos=True)
    [[full]] = engine.generate(["What is 3+8?"], base)
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    # A stop string taken from the middle of the free-running text ends the completion there.
    stop = full.text[5:7]
    [[stopped]] = engine.generate(["What is 3+8?"], SamplingParams(**{**base.__dict__, "stop": (stop,)}))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stop not in stopped.text
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    # A stop token id ends the completion and is kept in token_ids (like eos).
    token = full.token_ids[6]
    [[by_token]] = engine.generate(
        ["What is 3+8?"], SamplingParams(**{**base.__dict__, "stop_token_ids": (token,)})
    )
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(token) + 1]


def test_streaming_events_add_up_to_the_completion(engine: HFEngine) -> None:
    events: list[TokenEvent] = []
    request = GenerationRequest(
        prompt="What is 3+8?",
        on_token=events.append,
        params=SamplingParams(temperature=1.0, max_tokens=20, seed=9, n=2, stop=("e ",)),
    )
    [choices] = engine.generate([request])
    for c in choices:
        mine = [e for e in events if e.index == c.index]
        assert [e.token_id for e in mine] == list(c.token_ids)
        assert "".join(e.text for e in mine) == c.text
        assert [e.finish_reason for e in mine][-1] == c.finish_reason
        assert all(e.finish_reason is None for e in mine[:-1])


def test_cancel_stops_a_request(engine: HFEngine) -> None:
    cancel = threading.Event()
    seen: list[int] = []

    def on_token(event: TokenEvent) -> None:
        seen.append(event.token_id)
        if len(seen) == 3:
            cancel.set()

    request = GenerationRequest(
        prompt="hello",
        on_token=on_token,
        cancel=cancel,
        params=SamplingParams(max_tokens=200, ignore_eos=True, seed=0),
    )
    [[c]] = engine.generate([request])
    assert c.finish_reason == "cancelled"
    assert len(c.token_ids) == 3


def test_token_id_prompts_and_checks(engine: HFEngine) -> None:
    ids = engine.tokenize("What is 3+8?")
    [[by_ids]] = engine.generate(
        [GenerationRequest(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=5)
    )
    [[by_text]] = engine.generate(["What is 3+8?"], SamplingParams(temperature=0, max_tokens=5))
    assert by_ids.token_ids == by_text.token_ids
    with pytest.raises(GenerationError, match="at most"):
        engine.generate([GenerationRequest(prompt_token_ids=(5,) * engine.max_model_len)])
    with pytest.raises(GenerationError, match="empty"):
        engine.generate([""])
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(max_tokens=0)


def test_update_weights_in_place(tiny_model_dir: Path, other_weights_dir: Path) -> None:
    eng = load_hf_engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = eng.generate(PROMPTS, params)
    model_id = id(eng.model)
    assert eng.update_weights(other_weights_dir) == 1
    after = eng.generate(PROMPTS, params)
    assert [cs[0].token_ids for cs in after] != [cs[0].token_ids for cs in before]
    assert after[0][0].weights_version == 1 and id(eng.model) == model_id
    original = load_hf_engine(tiny_model_dir).model.state_dict()
    assert eng.update_weights(original) == 2  # a state dict, e.g. straight from a trainer
    assert [cs[0].token_ids for cs in eng.generate(PROMPTS, params)] == [cs[0].token_ids for cs in before]
    with pytest.raises(ModelError, match="unknown tensors"):
        eng.update_weights({"not.a.weight": torch.zeros(1)})
    name = next(iter(original))
    with pytest.raises(ModelError, match="shape"):
        eng.update_weights({name: torch.zeros(3)})


def test_each_distinct_prompt_is_prefilled_once(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.inference.hf_engine import HFSession

    engine = load_hf_engine(tiny_model_dir, max_batch_size=32)
    widths: list[int] = []
    forward = HFSession._forward

    def counting(self, ids, mask, positions, *, cache):  # noqa: ANN001, ANN202
        widths.append(ids.shape[0])
        return forward(self, ids, mask, positions, cache=cache)

    monkeypatch.setattr(HFSession, "_forward", counting)
    params = SamplingParams(temperature=1.0, max_tokens=4, n=8, seed=5, ignore_eos=True)
    results = engine.generate(["What is 3+8?", "What is 2+2?", "What is 3+8?"], params)
    assert widths[0] == 2 and widths[1] == 24  # prefill: 2 distinct prompts; decode: 3 x 8 rows
    for choices in results:  # and every row still samples on its own, with exact log-probs
        assert len({c.token_ids for c in choices}) > 1
        for c in choices:
            expected = teacher_forced_logprobs(engine.model, c.prompt_token_ids, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    assert [c.token_ids for c in results[0]] == [c.token_ids for c in results[2]]  # same prompt, same seed


def test_sampled_tokens_follow_the_tempered_distribution(engine: HFEngine) -> None:
    """3,000 one-token completions of one prompt, each request its own seed, at temperature 0.3: the
    counts match the tempered probabilities the engine reports (chi-square over the tokens expected >= 5 times;
    a sampler that ignored the temperature, or reused one random stream, lands far above the bound)."""
    import math
    from collections import Counter

    n = 3000
    requests = [
        GenerationRequest(prompt=PROMPTS[0], params=SamplingParams(temperature=0.3, max_tokens=1, seed=i, tempered_logprobs=True))
        for i in range(n)
    ]
    choices = [c[0] for c in engine.generate(requests)]
    counts = Counter(c.token_ids[0] for c in choices)
    prob = {c.token_ids[0]: math.exp(c.logprobs[0]) for c in choices}
    kept = [t for t in prob if n * prob[t] >= 5]
    assert len(kept) >= 5, "the test needs a spread distribution"
    chi_square = sum((counts[t] - n * prob[t]) ** 2 / (n * prob[t]) for t in kept)
    # the kept tokens' own mass, and what falls outside them, are one more cell
    rest_expected = n * (1 - sum(prob[t] for t in kept))
    rest_seen = n - sum(counts[t] for t in kept)
    if rest_expected >= 5:
        chi_square += (rest_seen - rest_expected) ** 2 / rest_expected
    dof = len(kept) - (0 if rest_expected >= 5 else 1)
    assert chi_square < dof + 6 * math.sqrt(2 * dof), (chi_square, dof)  # mean dof, sd sqrt(2 dof)
