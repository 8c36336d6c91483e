"""Token-exact episodes: prompt ids + sampled ids + continuation ids equal the template's rendering.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/rl/test_chat_tokens.py -q -p no:cacheprovider
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

from rollout.models.tiny import CHAT_TEMPLATE, train_tokenizer, wrap_tokenizer  # noqa: E402
from rollout.rl.chat_tokens import ChatTemplateError, continuation_ids, prompt_ids  # noqa: E402
from rollout.tasks.calculator import calculator_tool  # noqa: E402

# The tiny model's ChatML template before tools were added: without tools the rendering must not change.
OLD_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
TOOLS_BLOCK = "<|im_start|>system\nTools: calculator(expression: string)<|im_end|>\n"

# user -> call -> tool -> two calls -> two tools -> final answer: three assistant turns.
CONVERSATION = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 123*45+678*90?"},
    {"role": "assistant", "content": CALL % "123*45"},
    {"role": "tool", "content": "5535"},
    {"role": "assistant", "content": (CALL % "678*90") + "\n" + (CALL % "5535+61020")},
    {"role": "tool", "content": "61020"},
    {"role": "tool", "content": "66555"},
    {"role": "assistant", "content": "The answer is 66555."},
]


@pytest.fixture(scope="module")
def tok():
    return wrap_tokenizer(train_tokenizer(512), model_max_length=512)


@pytest.fixture(scope="module")
def schemas():
    return [calculator_tool().openai_schema()]


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def build_episode(tokenizer, messages, sampled: dict[int, list[int]], *, tools=None) -> list[int]:
    """What an episode loop does: the prompt, then per turn the sampled ids + eos, then the env's messages."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = prompt_ids(tokenizer, messages[:first], tools=tools)
    i = first
    while i < len(messages):
        assert messages[i]["role"] == "assistant"
        ids += sampled[i] + [tokenizer.eos_token_id]
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j < len(messages):
            ids += continuation_ids(tokenizer, messages[i + 1 : j], tools=tools)
        i = j
    return ids


def test_episode_ids_equal_the_rendered_conversation(tok, schemas) -> None:
    sampled = {i: encode(tok, m["content"]) for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"}
    for tools in (None, schemas):
        ids = build_episode(tok, CONVERSATION, sampled, tools=tools)
        full = template_ids(tok, CONVERSATION, tools=tools)
        # the template adds "\n" after the last <|im_end|>; everything before it matches token for token
        assert ids == full[: len(ids)]
        assert full[len(ids) :] == encode(tok, "\n")


def test_continuation_of_a_tool_result(tok, schemas) -> None:
    ids = continuation_ids(tok, [{"role": "tool", "content": "5535"}], tools=schemas)
    assert tok.decode(ids) == "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n"
    assert ids[1] == tok.convert_tokens_to_ids("<|im_start|>")  # a special token, never its characters
    no_prompt = continuation_ids(tok, [{"role": "user", "content": "Sure?"}], add_generation_prompt=False)
    assert tok.decode(no_prompt) == "\n<|im_start|>user\nSure?<|im_end|>\n"


def test_prompt_ids_are_the_template_with_the_generation_prompt(tok, schemas) -> None:
    messages = CONVERSATION[:2]
    assert prompt_ids(tok, messages) == template_ids(tok, messages, add_generation_prompt=True)
    with_tools = prompt_ids(tok, messages, tools=[calculator_tool()])  # Tool objects work like their schemas
    assert with_tools == template_ids(tok, messages, tools=schemas, add_generation_prompt=True)
    assert tok.decode(with_tools).startswith(TOOLS_BLOCK)


def one_token_per_char(tokenizer, text: str) -> list[int]:
    ids = []
    for char in text:
        piece = encode(tokenizer, char)
        assert len(piece) == 1, (char, piece)
        ids += piece
    return ids


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 66555.",  # merged words ("The", " answer") sampled letter by letter
        "  the  answer\t\tis 66555 ",  # odd whitespace
        "<tool_c",  # a half-written tag
    ],
)
def test_sampled_ids_are_kept_verbatim(tok, schemas, text: str) -> None:
    odd = one_token_per_char(tok, text)
    assert tok.decode(odd) == text
    assert encode(tok, text) != odd  # re-tokenising the text would change the ids: the test can fail
    messages = [*CONVERSATION[:7], {"role": "assistant", "content": text}]
    sampled = {i: encode(tok, m["content"]) for i, m in enumerate(messages) if m["role"] == "assistant"}
    sampled[7] = odd
    ids = build_episode(tok, messages, sampled, tools=schemas)
    assert ids[-len(odd) - 1 :] == [*odd, tok.eos_token_id]
    # same text as the template's rendering, other ids: nothing was re-tokenised
    full_text = tok.apply_chat_template(messages, tools=schemas, tokenize=False)
    assert tok.decode(ids) + "\n" == full_text
    assert ids != template_ids(tok, messages, tools=schemas)[: len(ids)]


def test_odd_ids_earlier_in_the_episode_do_not_move_later_turns(tok) -> None:
    sampled = {i: encode(tok, m["content"]) for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"}
    sampled[2] = one_token_per_char(tok, CONVERSATION[2]["content"])
    ids = build_episode(tok, CONVERSATION, sampled)
    tail = build_episode(tok, CONVERSATION, {**sampled, 2: encode(tok, CONVERSATION[2]["content"])})
    last = len(sampled[7]) + 1
    assert ids[-last:] == tail[-last:]
    assert len(ids) - len(tail) == len(sampled[2]) - len(encode(tok, CONVERSATION[2]["content"]))


# --- the tools block of the tiny template ------------------------------------------------------


def test_no_tools_renders_exactly_the_old_template(tok) -> None:
    old = with_template(tok, OLD_CHAT_TEMPLATE)
    assert tok.chat_template == CHAT_TEMPLATE != OLD_CHAT_TEMPLATE
    conversations = [CONVERSATION, CONVERSATION[:2], CONVERSATION[1:4], [{"role": "user", "content": ""}]]
    for messages in conversations:
        for generation_prompt in (False, True):
            for tools in (None, []):
                kwargs = {"tokenize": False, "add_generation_prompt": generation_prompt}
                assert tok.apply_chat_template(messages, tools=tools, **kwargs) == old.apply_chat_template(
                    messages, **kwargs
                )
    new = tok.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ref = old.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    assert new["input_ids"] == ref["input_ids"] and new["assistant_masks"] == ref["assistant_masks"]


def test_tools_render_as_one_leading_system_block(tok, schemas) -> None:
    messages = CONVERSATION[1:2]
    text = tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert text == TOOLS_BLOCK + "<|im_start|>user\nWhat is 123*45+678*90?<|im_end|>\n<|im_start|>assistant\n"
    # ... byte-identical to an explicit system message (SFT rows can carry the block that way)
    explicit = [{"role": "system", "content": "Tools: calculator(expression: string)"}, *messages]
    assert tok.apply_chat_template(explicit, tokenize=False, add_generation_prompt=True) == text

    search = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Not rendered.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Not rendered either."},
                    "k": {"type": "integer"},
                    "mode": {"type": ["string", "null"]},
                    "filter": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                },
                "required": ["query"],
            },
        },
    }
    no_args = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    text = tok.apply_chat_template(messages, tools=[*schemas, search, no_args], tokenize=False)
    assert text.startswith(
        "<|im_start|>system\nTools: calculator(expression: string),"
        " search(query: string, k?: integer, mode?: string|null, filter?: any), now()<|im_end|>\n"
    )
    assert "rendered" not in text and "evaluate" not in text.lower()


def test_assistant_mask_with_tools_covers_only_assistant_turns(tok, schemas) -> None:
    out = tok.apply_chat_template(
        CONVERSATION, tools=schemas, return_dict=True, return_assistant_tokens_mask=True
    )
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    expected = "".join(m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant")
    assert tok.decode(masked) == expected


# --- templates that can't be continued ---------------------------------------------------------


def test_a_template_that_rewrites_past_turns_is_refused(tok) -> None:
    # keeps only the last assistant message's content, like templates that strip past reasoning
    rewriting = OLD_CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|im_end|>' -}}",
        "{{- (message['content'] if loop.last else '') + '<|im_end|>' -}}",
    )
    assert rewriting != OLD_CHAT_TEMPLATE
    bad = with_template(tok, rewriting)
    with pytest.raises(ValueError, match="not prefix-stable"):
        continuation_ids(bad, [{"role": "tool", "content": "5535"}])
    with pytest.raises(ChatTemplateError):
        continuation_ids(bad, [{"role": "user", "content": "again"}])


def test_turn_end_must_close_assistant_turns(tok) -> None:
    endoftext = with_template(tok, OLD_CHAT_TEMPLATE.replace("<|im_end|>", "<|endoftext|>"))
    with pytest.raises(ValueError, match="does not end assistant turns with '<\\|im_end\\|>'"):
        continuation_ids(endoftext, [{"role": "tool", "content": "1"}])
    ids = continuation_ids(endoftext, [{"role": "tool", "content": "1"}], turn_end="<|endoftext|>")
    assert endoftext.decode(ids) == "\n<|im_start|>tool\n1<|endoftext|>\n<|im_start|>assistant\n"
