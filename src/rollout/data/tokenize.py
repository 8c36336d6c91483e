"""Turn validated rows into token ids and loss masks.

    samples, stats = tokenize_sft(rows, tokenizer, loss_on="assistant", max_seq_len=512, path=path)
    pairs, stats = tokenize_pairs(rows, tokenizer, max_seq_len=512, path=path)

`tokenizer` is a Hugging Face (fast) tokenizer; nothing heavy is imported here.

Conventions (the loss code relies on them):

- `loss_mask[i]` is True when token `i` is a training target, i.e. the logits
  at position `i - 1` are trained to predict it. So `loss_mask[0]` is always
  False: the first token has nothing to be predicted from.
- Strings are concatenated as plain text, without the chat template and
  without special tokens from the tokenizer call: `ids(prompt) + ids(completion)
  + [eos]`. Message lists go through the tokenizer's chat template; the
  completion of a `prompt`/`completion` (or `chosen`/`rejected`) pair of
  message lists is what follows the rendering of the prompt with
  `add_generation_prompt=True` (as in TRL).
- `loss_on="assistant"` (and `"completion"` on `messages` lines) needs the
  template to mark assistant tokens with `{% generation %}` blocks; we read
  them through `return_assistant_tokens_mask=True`. "completion" on a
  `messages` line is the last assistant turn: the last contiguous run of the
  assistant mask.
- Too-long samples keep their first `max_seq_len` tokens (`num_truncated`);
  a sample left without a loss token is dropped (`num_dropped`).

Tokenizer calls are batched per line shape (10k short chat lines: about a second).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollout.data.jsonl import Row
from rollout.errors import DataError, ModelError

if TYPE_CHECKING:  # annotations only: this module never imports transformers
    from transformers import PreTrainedTokenizerBase as Tokenizer

LossOn = Literal["full", "completion", "assistant"]
LOSS_ON = ("full", "completion", "assistant")

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TokenizedSample:
    """One SFT sample; `loss_mask[i]` True => token i is a target (predicted from i - 1)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]


@dataclass(frozen=True)
class TokenizeStats:
    """`num_samples` kept (pairs for `tokenize_pairs`); tokens are counted over kept samples only."""

    num_samples: int
    num_truncated: int
    num_dropped: int
    num_tokens: int
    num_loss_tokens: int


@dataclass(frozen=True)
class TokenizedPair:
    """A preference pair: prompt + chosen and prompt + rejected, each starting with its prompt tokens."""

    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    prompt_len_chosen: int
    prompt_len_rejected: int


# --- SFT --------------------------------------------------------------------------


def tokenize_sft(
    rows: Sequence[Row],
    tokenizer: Tokenizer,
    *,
    loss_on: LossOn,
    max_seq_len: int,
    path: Path | None = None,
) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenize sft lines (`messages`, `prompt`+`completion`, or `text`) with their loss masks."""
    _check_max_seq_len(max_seq_len)
    samples, stats, _ = cut_samples(encode_sft(rows, tokenizer, loss_on=loss_on, path=path), max_seq_len)
    return samples, stats


EncodedSample = tuple[list[int], list[bool]]
"""A line's token ids and loss mask, whole: `encode_sft`'s item, which `cut_samples` truncates."""


def encode_sft(
    rows: Sequence[Row], tokenizer: Tokenizer, *, loss_on: LossOn, path: Path | None = None
) -> list[EncodedSample]:
    """Every line's ids and loss mask at its full length, in line order (the costly half of
    `tokenize_sft`: a plan measures these, a recipe cuts them to its `max_seq_len`)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    eos = _eos_id(tokenizer)

    by_shape: dict[str, list[int]] = {"messages": [], "pc_text": [], "pc_chat": [], "text": []}
    for i, row in enumerate(rows):
        shape = _sft_shape(row)
        if shape == "text" and loss_on != "full":
            raise DataError(
                f'{_where(path, row)}: loss_on="{loss_on}" needs prompt/completion or messages lines'
            )
        by_shape[shape].append(i)

    encoders = {
        "messages": lambda rs: _encode_messages(rs, tokenizer, loss_on),
        "pc_text": lambda rs: _encode_pc_text(rs, tokenizer, loss_on, eos),
        "pc_chat": lambda rs: _encode_pc_chat(rs, tokenizer, loss_on, path),
        "text": lambda rs: _encode_text(rs, tokenizer, eos),
    }
    encoded: list[EncodedSample | None] = [None] * len(rows)
    for shape, indices in by_shape.items():
        for i, item in zip(indices, encoders[shape]([rows[i] for i in indices]), strict=True):
            encoded[i] = item
    return encoded  # type: ignore[return-value]  # every position filled above


def cut_samples(
    encoded: Sequence[EncodedSample], max_seq_len: int
) -> tuple[list[TokenizedSample], TokenizeStats, list[int]]:
    """`encode_sft`'s lines cut to their first `max_seq_len` tokens, those left without a loss
    token dropped; with the kept lines' positions (per-line fields such as labels follow them)."""
    samples: list[TokenizedSample] = []
    kept: list[int] = []
    num_truncated = num_dropped = num_tokens = num_loss_tokens = 0
    for i, (ids, mask) in enumerate(encoded):
        if len(ids) > max_seq_len:
            num_truncated += 1
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        mask = [False, *mask[1:]] if mask else mask
        loss_tokens = sum(mask)
        if loss_tokens == 0:
            num_dropped += 1
            continue
        samples.append(TokenizedSample(input_ids=tuple(ids), loss_mask=tuple(mask)))
        kept.append(i)
        num_tokens += len(ids)
        num_loss_tokens += loss_tokens
    stats = TokenizeStats(
        num_samples=len(samples),
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_tokens=num_tokens,
        num_loss_tokens=num_loss_tokens,
    )
    return samples, stats, kept


def _sft_shape(row: Row) -> str:
    data = row.data
    if "messages" in data:
        return "messages"
    if "prompt" in data:
        return "pc_text" if isinstance(data["prompt"], str) else "pc_chat"
    if "text" in data:
        return "text"
    raise DataError(f"{_where(None, row)}: not an sft line (validate it with read_rows first)")


def _encode_messages(
    rows: list[Row], tokenizer: Tokenizer, loss_on: LossOn
) -> list[tuple[list[int], list[bool]]]:
    if not rows:
        return []
    need_mask = loss_on != "full"
    if need_mask:
        _require_generation_markers(tokenizer, loss_on)
    ids_list, masks = _render_chats(
        tokenizer, [row.data["messages"] for row in rows], assistant_mask=need_mask,
        tools=[row.data.get("tools") for row in rows],
    )
    out = []
    for ids, mask in zip(ids_list, masks or [None] * len(ids_list), strict=True):
        if loss_on == "full":
            loss = [True] * len(ids)
        elif loss_on == "assistant":
            loss = [bool(m) for m in mask]
        else:
            loss = _last_run(mask)
        out.append((ids, loss))
    return out


def _encode_pc_text(
    rows: list[Row], tokenizer: Tokenizer, loss_on: LossOn, eos: int
) -> list[tuple[list[int], list[bool]]]:
    prompts = _encode_texts(tokenizer, [row.data["prompt"] for row in rows])
    completions = _encode_texts(tokenizer, [row.data["completion"] for row in rows])
    out = []
    for p, c in zip(prompts, completions, strict=True):
        c = [*c, eos]
        prompt_is_target = loss_on == "full"
        out.append(([*p, *c], [prompt_is_target] * len(p) + [True] * len(c)))
    return out


def _encode_pc_chat(
    rows: list[Row], tokenizer: Tokenizer, loss_on: LossOn, path: Path | None
) -> list[tuple[list[int], list[bool]]]:
    if not rows:
        return []
    if loss_on == "assistant":
        _require_generation_markers(tokenizer, loss_on)
    full, masks = _render_chats(
        tokenizer,
        [row.data["prompt"] + row.data["completion"] for row in rows],
        assistant_mask=loss_on == "assistant",
    )
    prompts = _render_prompts(tokenizer, [row.data["prompt"] for row in rows])
    out = []
    for k, (row, ids, p) in enumerate(zip(rows, full, prompts, strict=True)):
        _check_prefix(p, ids, row, path, "completion")
        if loss_on == "full":
            loss = [True] * len(ids)
        elif loss_on == "assistant":
            assert masks is not None
            loss = [bool(m) for m in masks[k]]
        else:
            loss = [False] * len(p) + [True] * (len(ids) - len(p))
        out.append((ids, loss))
    return out


def _encode_text(rows: list[Row], tokenizer: Tokenizer, eos: int) -> list[tuple[list[int], list[bool]]]:
    out = []
    for ids in _encode_texts(tokenizer, [row.data["text"] for row in rows]):
        ids = [*ids, eos]
        out.append((ids, [True] * len(ids)))
    return out


def _last_run(mask: Sequence[int]) -> list[bool]:
    """Keep only the last contiguous run of ones (the last assistant turn)."""
    loss = [False] * len(mask)
    i = len(mask) - 1
    while i >= 0 and not mask[i]:
        i -= 1
    while i >= 0 and mask[i]:
        loss[i] = True
        i -= 1
    return loss


# --- preference pairs -------------------------------------------------------------


def tokenize_pairs(
    rows: Sequence[Row],
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    path: Path | None = None,
) -> tuple[list[TokenizedPair], TokenizeStats]:
    """Tokenize preference lines into (prompt + chosen, prompt + rejected) pairs.

    Strings: `ids(prompt) + ids(answer) + [eos]`; message lists: the chat
    template of prompt + answer, whose first `prompt_len_*` tokens must be the
    prompt rendered with `add_generation_prompt=True`. Both sides keep their
    first `max_seq_len` tokens. A pair is dropped when a side has no answer
    token left or both sides became identical. `num_loss_tokens` counts the
    answer tokens of both sides.
    """
    _check_max_seq_len(max_seq_len)
    pairs, stats, _ = cut_pairs(encode_pairs(rows, tokenizer, path=path), max_seq_len)
    return pairs, stats


EncodedPair = tuple[list[int], list[int], int, int]
"""prompt + chosen ids, prompt + rejected ids, and the prompt's length on each side, whole."""


def encode_pairs(rows: Sequence[Row], tokenizer: Tokenizer, *, path: Path | None = None) -> list[EncodedPair]:
    """Every preference line's two sides at full length, in line order (`tokenize_pairs`' costly half)."""
    eos = _eos_id(tokenizer)
    text_idx = [i for i, row in enumerate(rows) if isinstance(row.data["prompt"], str)]
    chat_idx = [i for i, row in enumerate(rows) if not isinstance(row.data["prompt"], str)]

    encoded: list[EncodedPair | None] = [None] * len(rows)
    if text_idx:
        take = [rows[i].data for i in text_idx]
        prompts = _encode_texts(tokenizer, [d["prompt"] for d in take])
        chosen = _encode_texts(tokenizer, [d["chosen"] for d in take])
        rejected = _encode_texts(tokenizer, [d["rejected"] for d in take])
        for i, p, c, r in zip(text_idx, prompts, chosen, rejected, strict=True):
            encoded[i] = ([*p, *c, eos], [*p, *r, eos], len(p), len(p))
    if chat_idx:
        take_rows = [rows[i] for i in chat_idx]
        prompts = _render_prompts(tokenizer, [row.data["prompt"] for row in take_rows])
        chosen, _ = _render_chats(tokenizer, [row.data["prompt"] + row.data["chosen"] for row in take_rows])
        rejected, _ = _render_chats(
            tokenizer, [row.data["prompt"] + row.data["rejected"] for row in take_rows]
        )
        for i, row, p, c, r in zip(chat_idx, take_rows, prompts, chosen, rejected, strict=True):
            _check_prefix(p, c, row, path, "chosen")
            _check_prefix(p, r, row, path, "rejected")
            encoded[i] = (c, r, len(p), len(p))
    return encoded  # type: ignore[return-value]  # every position filled above


def cut_pairs(
    encoded: Sequence[EncodedPair], max_seq_len: int
) -> tuple[list[TokenizedPair], TokenizeStats, list[int]]:
    """`encode_pairs`' lines with both sides cut to `max_seq_len` tokens; a pair left without an
    answer token on a side, or with both sides the same, is dropped. With the kept positions."""
    pairs: list[TokenizedPair] = []
    kept: list[int] = []
    num_truncated = num_dropped = num_tokens = num_loss_tokens = 0
    for i, (c, r, pc, pr) in enumerate(encoded):
        if len(c) > max_seq_len or len(r) > max_seq_len:
            num_truncated += 1
            c, r = c[:max_seq_len], r[:max_seq_len]
            pc, pr = min(pc, max_seq_len), min(pr, max_seq_len)
        if len(c) <= pc or len(r) <= pr or c == r:
            num_dropped += 1
            continue
        pairs.append(TokenizedPair(tuple(c), tuple(r), pc, pr))
        kept.append(i)
        num_tokens += len(c) + len(r)
        num_loss_tokens += len(c) - pc + len(r) - pr
    stats = TokenizeStats(
        num_samples=len(pairs),
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_tokens=num_tokens,
        num_loss_tokens=num_loss_tokens,
    )
    return pairs, stats, kept


# --- tokenizer helpers ------------------------------------------------------------


def has_generation_markers(tokenizer: Tokenizer) -> bool:
    """Whether the chat template marks assistant tokens with `{% generation %}` blocks."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def _require_chat_template(tokenizer: Tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the tokenizer has no chat template, which lines with message lists need")


def _require_generation_markers(tokenizer: Tokenizer, loss_on: str) -> None:
    _require_chat_template(tokenizer)
    if not has_generation_markers(tokenizer):
        raise ModelError(
            f'loss_on="{loss_on}" needs a chat template that marks assistant tokens with'
            " {% generation %} ... {% endgeneration %}, and this tokenizer's template has none;"
            ' use loss_on="full" (or "completion" with prompt/completion lines) or a template with the markers'
        )


def _eos_id(tokenizer: Tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ModelError("the tokenizer has no eos token, which ends every plain-text sample")
    return eos


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Plain token ids of each string, no special tokens added (one batched call)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _render_chats(
    tokenizer: Tokenizer,
    conversations: list[list[dict]],
    *,
    assistant_mask: bool = False,
    tools: list[list[dict] | None] | None = None,
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Chat-template token ids (and the assistant masks when asked) of many conversations.

    `tools[i]` (a line's "tools" field, OpenAI tool schemas) goes to the template as `tools=`,
    as TRL's SFT does; conversations with the same tools are rendered in one call."""
    if not conversations:
        return [], [] if assistant_mask else None
    _require_chat_template(tokenizer)
    groups: dict[str, list[int]] = {}
    for i, row_tools in enumerate(tools or [None] * len(conversations)):
        groups.setdefault(json.dumps(row_tools, sort_keys=True) if row_tools else "", []).append(i)
    ids: list[list[int]] = [[] for _ in conversations]
    masks: list[list[int]] = [[] for _ in conversations]
    for key, idx in groups.items():
        out = tokenizer.apply_chat_template(
            [conversations[i] for i in idx],
            tools=json.loads(key) if key else None,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_mask,
        )
        for j, i in enumerate(idx):
            ids[i] = list(out["input_ids"][j])
            if assistant_mask:
                masks[i] = list(out["assistant_masks"][j])
    return ids, masks if assistant_mask else None


def _render_prompts(tokenizer: Tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    if not prompts:
        return []
    _require_chat_template(tokenizer)
    out = tokenizer.apply_chat_template(prompts, tokenize=True, return_dict=True, add_generation_prompt=True)
    return [list(x) for x in out["input_ids"]]


def _check_prefix(prompt_ids: list[int], ids: list[int], row: Row, path: Path | None, field: str) -> None:
    if ids[: len(prompt_ids)] != prompt_ids:
        raise DataError(
            f"{_where(path, row)}: the chat template's rendering of the prompt (with add_generation_prompt)"
            f' is not a prefix of its rendering of prompt + "{field}"'
        )


def _check_max_seq_len(max_seq_len: int) -> None:
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")


def _where(path: Path | None, row: Row) -> str:
    """The row's own location (set by the readers), else `path:line`."""
    if row.location:
        return row.location
    return f"{path}:{row.line}" if path is not None else f"line {row.line}"

