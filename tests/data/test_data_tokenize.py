"""Tokenization to ids + loss masks, checked token by token against the decoded text."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tiny_chatml_tokenizer import CHATML_TEMPLATE, build_chatml_tokenizer

from rollout.data.jsonl import Row
from rollout.data.tokenize import (
    TokenizedPair,
    TokenizedSample,
    has_generation_markers,
    tokenize_pairs,
    tokenize_sft,
)
from rollout.errors import DataError, ModelError

EOS = "<|im_end|>"
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
)


def rows(*datas: dict) -> list[Row]:
    return [Row(line=i + 1, data=d) for i, d in enumerate(datas)]


def loss_runs(tokenizer, sample: TokenizedSample) -> list[str]:
    """The decoded text of every contiguous run of loss tokens."""
    runs: list[list[int]] = []
    previous = False
    for tok, is_target in zip(sample.input_ids, sample.loss_mask, strict=True):
        if is_target and not previous:
            runs.append([])
        if is_target:
            runs[-1].append(tok)
        previous = is_target
    return [tokenizer.decode(run) for run in runs]


def decode_each(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def test_messages_loss_on_each_mode(chatml_tokenizer):
    tok = chatml_tokenizer
    expected = {
        "full": None,
        "assistant": ["5<|im_end|>", "Paris.<|im_end|>"],
        "completion": ["Paris.<|im_end|>"],
    }
    for loss_on, runs in expected.items():
        (sample,), stats = tokenize_sft(rows({"messages": CONV}), tok, loss_on=loss_on, max_seq_len=512)
        assert tok.decode(sample.input_ids) == RENDERED
        assert len(sample.loss_mask) == len(sample.input_ids)
        assert sample.loss_mask[0] is False
        if loss_on == "full":
            assert all(sample.loss_mask[1:])
        else:
            assert loss_runs(tok, sample) == runs
        assert stats.num_loss_tokens == sum(sample.loss_mask)
        assert stats.num_tokens == len(sample.input_ids)


def test_assistant_mask_token_by_token(chatml_tokenizer):
    tok = chatml_tokenizer
    (sample,), _ = tokenize_sft(rows({"messages": CONV}), tok, loss_on="assistant", max_seq_len=512)
    pieces = decode_each(tok, sample.input_ids)
    # walk the rendered text: a token is a target iff it lies inside an assistant "content<|im_end|>" span
    text = "".join(pieces)
    assert text == RENDERED
    spans = []
    for content in ("5", "Paris."):
        start = text.index(f"<|im_start|>assistant\n{content}") + len("<|im_start|>assistant\n")
        spans.append((start, start + len(content) + len(EOS)))
    offset = 0
    for piece, is_target in zip(pieces, sample.loss_mask, strict=True):
        inside = any(a <= offset and offset + len(piece) <= b for a, b in spans)
        assert is_target == inside, (piece, offset)
        offset += len(piece)


def test_prompt_completion_strings(chatml_tokenizer):
    tok = chatml_tokenizer
    data = {"prompt": "Question: what is 2+3? Answer:", "completion": " 5"}
    p_ids = tok(data["prompt"], add_special_tokens=False)["input_ids"]
    c_ids = tok(data["completion"], add_special_tokens=False)["input_ids"]
    for loss_on in ("completion", "assistant", "full"):
        (sample,), stats = tokenize_sft(rows(data), tok, loss_on=loss_on, max_seq_len=512)
        assert sample.input_ids == (*p_ids, *c_ids, tok.eos_token_id)
        assert tok.decode(sample.input_ids) == data["prompt"] + data["completion"] + EOS
        if loss_on == "full":
            assert sample.loss_mask == (False,) + (True,) * (len(sample.input_ids) - 1)
        else:
            assert sample.loss_mask == (False,) * len(p_ids) + (True,) * (len(c_ids) + 1)
            assert loss_runs(tok, sample) == [" 5<|im_end|>"]
            assert stats.num_loss_tokens == len(c_ids) + 1


def test_prompt_completion_messages(chatml_tokenizer):
    tok = chatml_tokenizer
    prompt = CONV[:4]
    data = {"prompt": prompt, "completion": [CONV[4]]}
    (completion,), _ = tokenize_sft(rows(data), tok, loss_on="completion", max_seq_len=512)
    (assistant,), _ = tokenize_sft(rows(data), tok, loss_on="assistant", max_seq_len=512)
    (full,), _ = tokenize_sft(rows(data), tok, loss_on="full", max_seq_len=512)
    assert tok.decode(completion.input_ids) == RENDERED
    assert completion.input_ids == assistant.input_ids == full.input_ids
    # completion = everything after the prompt rendered with the generation prompt (TRL's convention)
    assert loss_runs(tok, completion) == ["Paris.<|im_end|>\n"]
    assert loss_runs(tok, assistant) == ["5<|im_end|>", "Paris.<|im_end|>"]
    assert all(full.loss_mask[1:])


def test_text_lines(chatml_tokenizer):
    tok = chatml_tokenizer
    (sample,), _ = tokenize_sft(rows({"text": "The quick brown fox."}), tok, loss_on="full", max_seq_len=512)
    assert tok.decode(sample.input_ids) == "The quick brown fox." + EOS
    assert sample.loss_mask == (False,) + (True,) * (len(sample.input_ids) - 1)
    data = rows({"prompt": "a", "completion": "b"}, {"text": "x"})
    with pytest.raises(DataError) as info:
        tokenize_sft(data, tok, loss_on="completion", max_seq_len=512, path=Path("data/sft.jsonl"))
    assert (
        str(info.value) == 'data/sft.jsonl:2: loss_on="completion" needs prompt/completion or messages lines'
    )
    with pytest.raises(DataError, match='^line 2: loss_on="assistant" needs'):
        tokenize_sft(data, tok, loss_on="assistant", max_seq_len=512)


def test_mixed_shapes_keep_row_order(chatml_tokenizer):
    tok = chatml_tokenizer
    data = rows(
        {"text": "one"},
        {"messages": CONV[:3]},
        {"prompt": "two", "completion": " three"},
        {"prompt": CONV[:2], "completion": CONV[2:3]},
        {"text": "four"},
    )
    samples, stats = tokenize_sft(data, tok, loss_on="full", max_seq_len=512)
    decoded = [tok.decode(s.input_ids) for s in samples]
    assert decoded[0] == "one" + EOS
    assert decoded[1].startswith("<|im_start|>system") and decoded[1].endswith("5<|im_end|>\n")
    assert decoded[2] == "two three" + EOS
    assert decoded[3] == decoded[1]
    assert decoded[4] == "four" + EOS
    assert stats.num_samples == 5 and stats.num_tokens == sum(len(s.input_ids) for s in samples)


def test_truncation_and_drops(chatml_tokenizer):
    tok = chatml_tokenizer
    long_prompt = "the model learns the answer " * 10
    data = rows(
        {"prompt": "Q", "completion": " the quick brown fox jumps over the lazy dog"},  # truncated, kept
        {"prompt": long_prompt, "completion": " 5"},  # truncated inside the prompt: no loss token left
        {"prompt": "Q", "completion": " 5"},  # short, untouched
    )
    samples, stats = tokenize_sft(data, tok, loss_on="completion", max_seq_len=8)
    assert stats.num_truncated == 2
    assert stats.num_dropped == 1
    assert stats.num_samples == 2 == len(samples)
    assert len(samples[0].input_ids) == 8 and len(samples[0].loss_mask) == 8
    assert tok.eos_token_id not in samples[0].input_ids
    assert samples[1].input_ids[-1] == tok.eos_token_id
    assert stats.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert stats.num_tokens == sum(len(s.input_ids) for s in samples)


def test_template_without_generation_markers(chatml_tokenizer):
    plain_template = CHATML_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    tok = build_chatml_tokenizer(template=plain_template)
    assert has_generation_markers(chatml_tokenizer) and not has_generation_markers(tok)
    data = rows({"messages": CONV})
    for loss_on in ("assistant", "completion"):
        with pytest.raises(ModelError, match=r"generation %\}"):
            tokenize_sft(data, tok, loss_on=loss_on, max_seq_len=512)
    (sample,), _ = tokenize_sft(data, tok, loss_on="full", max_seq_len=512)
    assert tok.decode(sample.input_ids) == RENDERED
    # prompt/completion message lists need no markers for loss_on="completion"
    (pc,), _ = tokenize_sft(
        rows({"prompt": CONV[:4], "completion": CONV[4:]}), tok, loss_on="completion", max_seq_len=512
    )
    assert loss_runs(tok, pc) == ["Paris.<|im_end|>\n"]


def test_no_chat_template():
    tok = build_chatml_tokenizer(template=None)
    with pytest.raises(ModelError, match="no chat template"):
        tokenize_sft(rows({"messages": CONV}), tok, loss_on="full", max_seq_len=512)
    (sample,), _ = tokenize_sft(rows({"text": "plain"}), tok, loss_on="full", max_seq_len=512)
    assert tok.decode(sample.input_ids) == "plain" + EOS


def test_prompt_that_is_not_a_prefix():
    # a template whose generation prompt differs from how it renders assistant turns
    template = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>model\\n'")
    tok = build_chatml_tokenizer(template=template)
    data = rows({"prompt": CONV[:2], "completion": CONV[2:3]})
    with pytest.raises(DataError) as info:
        tokenize_sft(data, tok, loss_on="completion", max_seq_len=512, path=Path("d.jsonl"))
    assert str(info.value).startswith("d.jsonl:1: the chat template's rendering of the prompt")


def test_pairs_strings_and_messages(chatml_tokenizer):
    tok = chatml_tokenizer
    data = rows(
        {"prompt": "Question: 2+3?", "chosen": " 5", "rejected": " 6"},
        {"prompt": CONV[:2], "chosen": [{"role": "assistant", "content": "5"}], "rejected": [CONV[4]]},
    )
    pairs, stats = tokenize_pairs(data, tok, max_seq_len=512)
    text_pair, chat_pair = pairs
    assert isinstance(text_pair, TokenizedPair)
    p = tok(data[0].data["prompt"], add_special_tokens=False)["input_ids"]
    assert text_pair.prompt_len_chosen == text_pair.prompt_len_rejected == len(p)
    assert text_pair.chosen_ids[: len(p)] == tuple(p) == text_pair.rejected_ids[: len(p)]
    assert tok.decode(text_pair.chosen_ids[len(p) :]) == " 5" + EOS
    assert tok.decode(text_pair.rejected_ids[len(p) :]) == " 6" + EOS

    prompt_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(chat_pair.chosen_ids[: chat_pair.prompt_len_chosen]) == prompt_text
    assert tok.decode(chat_pair.chosen_ids[chat_pair.prompt_len_chosen :]) == "5<|im_end|>\n"
    assert tok.decode(chat_pair.rejected_ids[chat_pair.prompt_len_rejected :]) == "Paris.<|im_end|>\n"
    assert stats.num_samples == 2 and stats.num_truncated == 0 and stats.num_dropped == 0
    assert stats.num_tokens == sum(len(x.chosen_ids) + len(x.rejected_ids) for x in pairs)
    assert stats.num_loss_tokens == sum(
        len(x.chosen_ids) - x.prompt_len_chosen + len(x.rejected_ids) - x.prompt_len_rejected for x in pairs
    )


def test_pairs_truncation_and_drops(chatml_tokenizer):
    tok = chatml_tokenizer
    data = rows(
        {"prompt": "Q", "chosen": " the quick brown fox jumps", "rejected": " no"},  # chosen truncated
        {"prompt": "the model learns the answer " * 5, "chosen": " a", "rejected": " b"},  # prompt fills it
        {"prompt": "Q", "chosen": " the quick brown fox jumps over", "rejected": " the quick brown fox runs"},
    )
    pairs, stats = tokenize_pairs(data, tok, max_seq_len=4)
    assert stats.num_truncated == 3
    # pair 2 loses every answer token, pair 3's two sides become identical
    assert stats.num_dropped == 2 and stats.num_samples == 1
    (pair,) = pairs

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    assert pair.chosen_ids == tuple([*ids("Q"), *ids(" the quick brown fox jumps"), tok.eos_token_id][:4])
    assert pair.rejected_ids == tuple([*ids("Q"), *ids(" no"), tok.eos_token_id][:4])
    assert pair.prompt_len_chosen == pair.prompt_len_rejected == len(ids("Q")) == 1


def test_tokenize_10k_chat_lines_speed(chatml_tokenizer):
    data = rows(*[{"messages": CONV[1:3]}] * 10_000)
    start = time.perf_counter()
    samples, stats = tokenize_sft(data, chatml_tokenizer, loss_on="assistant", max_seq_len=64)
    elapsed = time.perf_counter() - start
    assert stats.num_samples == 10_000 and len(samples) == 10_000
    print(f"tokenize_sft on 10k chat lines: {elapsed:.2f}s")
    assert elapsed < 30
