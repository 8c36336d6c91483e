"""Key/value caches kept between `generate` calls (`cache_key`): the next turn prefills only its new
tokens and samples what a full prefill samples; stale, mismatched or released caches are never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.inference.hf_engine import BATCH_INVARIANT_PAD, load_hf_engine
from rollout.inference.kept_cache import KeptCache, KeptCacheStore
from rollout.inference.types import GenerationRequest, SamplingParams

FIRST = SamplingParams(temperature=1.0, max_tokens=9, seed=5)
SECOND = SamplingParams(temperature=1.0, max_tokens=9, seed=6)
PROMPTS = [tuple(range(5, 12 + 5 * i)) for i in range(4)]  # 7, 12, 17, 22 tokens
TOOL = (40, 41, 42)  # what an env appends after the reply


@pytest.fixture(params=[1, BATCH_INVARIANT_PAD], ids=["pad1", "pad16"])
def fresh_engine(request, tiny_model_dir: Path):
    return load_hf_engine(tiny_model_dir, max_batch_size=16, model_name="tiny", pad_multiple=request.param)


def first_turn(engine, prefix: str) -> list[tuple[int, ...]]:
    """Turn 1 of each prompt with a cache key; the prompts of turn 2 (prompt + reply + tool answer)."""
    out = engine.generate([GenerationRequest(prompt_token_ids=p, params=FIRST, cache_key=f"{prefix}{i}")
                           for i, p in enumerate(PROMPTS)])
    return [p + choices[0].token_ids + TOOL[: 1 + i % 3] for i, (p, choices) in enumerate(zip(PROMPTS, out, strict=True))]


def assert_same_samples(got, want, tol: float = 1e-5) -> None:
    for (g,), (w,) in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) <= tol
        assert g.prompt_token_ids == w.prompt_token_ids


def test_a_continued_turn_prefills_only_its_new_tokens_and_samples_what_a_full_prefill_samples(fresh_engine):
    engine = fresh_engine
    second = first_turn(engine, "ep/")
    stats = dict(engine.kept_cache_stats)
    assert stats["kept"] == 4 and len(engine._kept) == 4
    continued = engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"ep/{i}")
                                 for i, p in enumerate(second)])
    after = engine.kept_cache_stats
    # the kept tokens are each prompt and its reply but the last sampled token (never fed)
    kept = sum(len(p) + FIRST.max_tokens - 1 for p in PROMPTS)
    assert after["reused"] - stats["reused"] == 4
    assert after["reused_tokens"] - stats["reused_tokens"] == kept
    assert after["prefilled_tokens"] - stats["prefilled_tokens"] == sum(map(len, second)) - kept
    assert len(engine._kept) == 4  # turn 2 kept its own caches under the same keys
    full = engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND) for p in second])
    assert_same_samples(continued, full)
    assert engine.release_cache("ep/") == 4 and len(engine._kept) == 0


def test_continued_fresh_and_multi_choice_rows_share_one_call(fresh_engine):
    engine = fresh_engine
    second = first_turn(engine, "mix/")
    requests = [GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"mix/{i}") for i, p in enumerate(second)]
    requests.insert(1, GenerationRequest(prompt_token_ids=PROMPTS[0], params=SECOND))  # a new conversation
    requests.append(GenerationRequest(prompt_token_ids=PROMPTS[2], params=SamplingParams(max_tokens=9, n=3, seed=1)))
    before = engine.kept_cache_stats["reused"]
    together = engine.generate(requests)
    assert engine.kept_cache_stats["reused"] - before == 4
    alone = engine.generate([GenerationRequest(prompt_token_ids=r.prompt_token_ids, params=r.params) for r in requests])
    for got, want in zip(together, alone, strict=True):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want, strict=True):
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-5


def test_batch_invariant_turns_give_a_conversation_the_same_bits_alone_and_among_others(tiny_model_dir: Path):
    """`pad_multiple = BATCH_INVARIANT_PAD`: the second turns of four conversations of 7-22 tokens (other
    16-token widths), continued from kept caches together or one at a time, sample the same tokens
    and bitwise the same log-probs, as do their first turns."""
    def turns(together: bool) -> list:
        engine = load_hf_engine(tiny_model_dir, max_batch_size=16, model_name="tiny", pad_multiple=BATCH_INVARIANT_PAD)
        first = [GenerationRequest(prompt_token_ids=p, params=FIRST, cache_key=f"c{i}") for i, p in enumerate(PROMPTS)]
        out = engine.generate(first) if together else [engine.generate([r])[0] for r in first]
        second = [GenerationRequest(prompt_token_ids=p + choices[0].token_ids + TOOL[: 1 + i % 3], params=SECOND,
                                    cache_key=f"c{i}") for i, (p, choices) in enumerate(zip(PROMPTS, out, strict=True))]
        out += engine.generate(second) if together else [engine.generate([r])[0] for r in second]
        assert engine.kept_cache_stats["reused"] == 4
        return [(c.token_ids, c.logprobs) for choices in out for c in choices]

    assert turns(together=True) == turns(together=False)


def test_greedy_multi_turn_with_kept_caches_equals_full_prefills(fresh_engine):
    """Four greedy turns: every turn continues the previous one's cache; the same tokens as re-prefilling."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    def conversation(keep: bool) -> list[tuple[int, ...]]:
        prompt, replies = PROMPTS[1], []
        for turn in range(4):
            [(reply,)] = fresh_engine.generate(
                [GenerationRequest(prompt_token_ids=prompt, params=greedy, cache_key="g" if keep else None)]
            )
            replies.append(reply.token_ids)
            prompt = prompt + reply.token_ids + (50 + turn, 51)
        return replies

    before = fresh_engine.kept_cache_stats["reused"]
    assert conversation(keep=True) == conversation(keep=False)
    assert fresh_engine.kept_cache_stats["reused"] - before == 3
    fresh_engine.release_cache("g")


def test_a_weight_update_drops_kept_caches(engine, tiny_model_dir: Path, other_weights_dir: Path):
    second = first_turn(engine, "w/")
    assert len(engine._kept) == 4
    try:
        engine.update_weights(other_weights_dir)
        assert len(engine._kept) == 0
        before = dict(engine.kept_cache_stats)
        continued = engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"w/{i}")
                                     for i, p in enumerate(second)])
        assert engine.kept_cache_stats["reused"] == before["reused"]
        assert_same_samples(continued, engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND)
                                                        for p in second]), tol=0.0)
    finally:
        engine.update_weights(tiny_model_dir)
        engine.release_cache("w/")


def test_a_prompt_that_does_not_extend_the_kept_tokens_prefills_it_all(engine):
    second = first_turn(engine, "x/")
    # the reply's third token rewritten: the kept cache is of other tokens
    other = [p[: len(q) + 2] + ((p[len(q) + 2] + 1) % 60,) + p[len(q) + 3 :] for p, q in zip(second, PROMPTS, strict=True)]
    before = dict(engine.kept_cache_stats)
    got = engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"x/{i}")
                           for i, p in enumerate(other)])
    assert engine.kept_cache_stats["reused"] == before["reused"]
    assert_same_samples(got, engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND) for p in other]),
                        tol=0.0)
    engine.release_cache("x/")


def test_requests_without_a_key_or_with_keep_cache_false_keep_nothing(engine):
    before = dict(engine.kept_cache_stats)
    engine.generate([GenerationRequest(prompt_token_ids=p, params=FIRST) for p in PROMPTS])
    assert engine.kept_cache_stats["kept"] == before["kept"] and len(engine._kept) == 0
    second = first_turn(engine, "last/")
    engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"last/{i}", keep_cache=False)
                     for i, p in enumerate(second)])  # a conversation's last turn: continues, keeps nothing
    assert engine.kept_cache_stats["reused"] - before["reused"] == 4
    assert engine.kept_cache_stats["kept"] - before["kept"] == 4 and len(engine._kept) == 0


def entry(n: int, version: int = 0) -> KeptCache:
    layer = (torch.zeros(2, n, 4), torch.zeros(2, n, 4))  # 2 x n x 4 float32 keys and values: 64 n bytes
    return KeptCache(tuple(range(n)), (layer,), version)


def test_the_store_evicts_the_least_recently_kept_over_its_byte_cap():
    store = KeptCacheStore(max_bytes=64 * 10)
    store.put("a", entry(4))
    store.put("b", entry(4))
    assert store.nbytes == 64 * 8
    store.put("c", entry(4))  # 12 tokens > 10: "a" goes
    assert store.take("a", tuple(range(9)), 0) is None
    assert store.take("b", tuple(range(9)), 0) is not None
    assert not store.put("d", entry(11))  # larger than the cap: not kept at all
    assert len(store) == 1 and store.evicted == 2 and store.nbytes == 64 * 4


def test_the_store_hands_out_an_entry_once_and_only_for_its_version_and_tokens():
    store = KeptCacheStore()
    store.put("k", entry(5, version=3))
    assert store.take("k", tuple(range(9)), 4) is None  # other weights: dropped
    assert len(store) == 0
    store.put("k", entry(5, version=3))
    assert store.take("k", tuple(range(5)), 3) is None  # nothing new to prefill
    store.put("k", entry(5, version=3))
    assert store.take("k", (9, *range(1, 9)), 3) is None  # does not extend the kept tokens
    store.put("k", entry(5, version=3))
    assert store.take("k", tuple(range(9)), 3) is not None
    assert store.take("k", tuple(range(9)), 3) is None
    store.put("run-1/0", entry(2))
    store.put("run-1/1", entry(2))
    store.put("run-2/0", entry(2))
    assert store.release("run-1/") == 2 and len(store) == 1 and store.nbytes == 64 * 2


def test_kept_cache_mb_zero_keeps_nothing_and_a_negative_size_is_refused(tiny_model_dir: Path):
    from rollout.errors import ConfigError
    from rollout.inference.build import build_engine
    from rollout.inference.config import InferenceConfig, with_overrides
    from rollout.inference.models import ResolvedModel

    cfg = with_overrides(InferenceConfig(), kept_cache_mb=0, device="cpu")
    engine = build_engine(cfg, ResolvedModel(str(tiny_model_dir), "tiny", fixed_identity=None))
    second = first_turn(engine, "z/")
    engine.generate([GenerationRequest(prompt_token_ids=p, params=SECOND, cache_key=f"z/{i}")
                     for i, p in enumerate(second)])
    assert engine.kept_cache_stats["kept"] == engine.kept_cache_stats["reused"] == 0
    assert engine._kept.evicted == 8  # each finished row was too large for a 0-byte store
    with pytest.raises(ConfigError, match="kept_cache_mb"):
        with_overrides(InferenceConfig(), kept_cache_mb=-1)
