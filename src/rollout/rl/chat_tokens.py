"""Token-exact multi-turn episodes (SPEC section 9, Episodes): the ids the chat template adds between turns.

    ids = prompt_ids(tokenizer, messages, tools=schemas)     # the opening prompt, generation prompt included
    ids += sampled                                           # the engine's ids, verbatim, ending in eos
    ids += continuation_ids(tokenizer, tool_msgs, tools=schemas)  # "\\n<|im_start|>tool\\n…assistant\\n"
    ids += sampled_2 ...

Sampled ids are never re-tokenised: decoding them and encoding the text again
can give other ids (BPE merges the "answer" the model sampled letter by
letter, odd whitespace, a half-written "<tool_c"), and the loss must see what
the model actually produced. Only env and tool messages are tokenised, once, as the
template renders them after an assistant turn.

How: render a fixed base conversation ending in an assistant turn, once alone
and once followed by the new messages; the continuation is the longer text
after the assistant's end-of-turn token (the "\\n" ChatML puts after
`<|im_end|>` belongs to it), tokenised without special tokens added. The cut
lies right after a special token, so no BPE merge crosses it. This relies on
the template rendering a turn the same whatever follows it (prefix-stable);
templates that rewrite earlier turns (e.g. ones that drop past reasoning) are
refused with a `ChatTemplateError`. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollout.errors import ModelError
from rollout.inference.types import Message
from rollout.rl.tools import Tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ToolsArg = Sequence[Tool | Mapping[str, Any]] | None
"""`Tool`s or their OpenAI schemas (`Tool.openai_schema()`), which `apply_chat_template(tools=)` takes."""

# Any short turn works: only the text after the assistant's end of turn is kept.
_BASE: tuple[Message, ...] = (
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "ok"},
)


class ChatTemplateError(ModelError, ValueError):
    """The chat template can't continue a conversation token-exactly (the CLI exits 2 on it)."""


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, tools: ToolsArg = None
) -> list[int]:
    """The opening prompt's ids: `messages` rendered with the generation prompt (and the tools block)."""
    text = _render(tokenizer, messages, tools=tools, add_generation_prompt=True)
    return _encode(tokenizer, text)


def continuation_ids(
    tokenizer: PreTrainedTokenizerBase,
    new_messages: Sequence[Message],
    *,
    tools: ToolsArg = None,
    add_generation_prompt: bool = True,
    turn_end: str | None = None,
) -> list[int]:
    """The ids the template puts after an assistant turn that ended with `turn_end`, for `new_messages`.

    `new_messages` are the env's answer (tool results, a user turn); with
    `add_generation_prompt` the next assistant header follows. `turn_end` is
    the token that closes assistant turns, the tokenizer's eos by default
    (`<|im_end|>` for ChatML). `tools` must be what the prompt was rendered
    with. Raises `ChatTemplateError` (a `ValueError`) when the template does
    not close assistant turns with `turn_end` or is not prefix-stable.
    """
    end = turn_end if turn_end is not None else tokenizer.eos_token
    if not end:
        raise ChatTemplateError(
            "the tokenizer has no eos token: pass turn_end= (the token that closes assistant turns)"
        )
    short = _render(tokenizer, _BASE, tools=tools, add_generation_prompt=False)
    marker = _BASE[-1]["content"] + end
    found = short.rfind(marker)
    if found < 0:
        raise ChatTemplateError(
            f"the chat template does not end assistant turns with {end!r}: rendered {short[-80:]!r};"
            " pass turn_end= with the token that does"
        )
    cut = found + len(marker)
    conversation = [*_BASE, *new_messages]
    long = _render(tokenizer, conversation, tools=tools, add_generation_prompt=add_generation_prompt)
    if not long.startswith(short[:cut]):
        raise ChatTemplateError(
            "the chat template is not prefix-stable: rendering more messages changes the earlier turns"
            f" (a template that rewrites past turns, e.g. strips past reasoning), so episodes can't be"
            f" continued token-exactly; ends {short[:cut][-60:]!r} alone but {long[: cut + 20][-80:]!r}"
            " with the new messages"
        )
    return _encode(tokenizer, long[cut:])


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: ToolsArg,
    add_generation_prompt: bool,
) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=_schemas(tools),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert isinstance(text, str), type(text)
    return text


def _schemas(tools: ToolsArg) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.openai_schema() if isinstance(t, Tool) else dict(t) for t in tools]


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The rendered text already holds every special token the template wants (bos included).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
