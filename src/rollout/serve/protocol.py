"""OpenAI request bodies (pydantic) and response shapes for `rollout serve`.

Bodies allow unknown fields (like OpenAI) but check the type and range of every
field they know; fields we can't honour (tools, penalties, logit_bias, echo,
suffix, images) are refused with 400 rather than silently ignored. vLLM's
extensions `top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids` and
`return_tokens_as_token_ids` are accepted, and rollout's own `tempered_logprobs`
(log-probs of the temperature-scaled distribution, what an RL trainer's importance
ratio needs; see `SamplingParams.tempered_logprobs`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.inference.types import Completion, TokenEvent

TokenText = Callable[[int], str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Sampling(_Body):
    model: str = Field(min_length=1)
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # rollout extension
    tempered_logprobs: bool | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], str):
            return list(p)  # type: ignore[arg-type]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return [list(x) for x in p]  # type: ignore[union-attr]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"{self.role} messages need content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class UpdateWeightsBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: str | None = None


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completions: Sequence[Completion]) -> dict[str, int]:
    generated = sum(c.completion_tokens for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }


def _token(token_id: int, token_text: TokenText, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else token_text(token_id)


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    token_text: TokenText,
    *,
    as_ids: bool,
) -> dict[str, Any]:
    """`choice.logprobs` of a chat completion: one entry per token with its top alternatives."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = _token(tid, token_text, as_ids)
        alternatives = top[i] if top is not None and i < len(top) else ()
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t := _token(a, token_text, as_ids)),
                        "logprob": v,
                        "bytes": list(t.encode("utf-8")),
                    }
                    for a, v in alternatives
                ],
            }
        )
    return {"content": content, "refusal": None}


def text_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    token_text: TokenText,
    *,
    as_ids: bool,
    offset: int = 0,
) -> dict[str, Any]:
    """`choice.logprobs` of a text completion (the legacy tokens / token_logprobs / top_logprobs shape)."""
    tokens = [_token(t, token_text, as_ids) for t in token_ids]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = None
    if top is not None:
        tops = [
            {_token(a, token_text, as_ids): v for a, v in (top[i] if i < len(top) else ())}
            for i in range(len(tokens))
        ]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ResponseFormatter:
    """Builds one response's JSON (whole, or as SSE chunks): ids, choices, log-probs, usage."""

    chat: bool
    model: str
    n: int
    want_logprobs: bool
    as_ids: bool
    return_ids: bool
    token_text: Callable[[int], str]
    fingerprint: str

    def __post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = now()
        self.object = "chat.completion" if self.chat else "text_completion"

    def _logprobs(self, ids: Any, lps: Any, top: Any) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        fn = chat_logprobs if self.chat else text_logprobs
        return fn(
            ids, lps, top if top is not None else [() for _ in ids], self.token_text, as_ids=self.as_ids
        )

    def response(self, results: list[tuple[Completion, ...]]) -> dict[str, Any]:
        choices = []
        for i, completions in enumerate(results):
            for c in completions:
                choice: dict[str, Any] = {
                    "index": i * self.n + c.index,
                    "finish_reason": c.finish_reason,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                }
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                if self.return_ids:
                    choice["token_ids"] = list(c.token_ids)
                    choice["prompt_token_ids"] = list(c.prompt_token_ids)
                choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self._usage(results),
        }
        if self.return_ids and results and results[0]:
            body["prompt_token_ids"] = list(results[0][0].prompt_token_ids)
        return body

    def _usage(self, results: list[tuple[Completion, ...]]) -> dict[str, int]:
        prompt = sum(cs[0].prompt_tokens for cs in results if cs)
        return usage(prompt, [c for cs in results for c in cs])

    def chunk(
        self,
        index: int,
        *,
        role: bool = False,
        event: TokenEvent | None = None,
        completion: Completion | None = None,
    ) -> dict[str, Any]:
        text, reason, logprobs = "", None, None
        if event is not None:
            text, reason = event.text, event.finish_reason
            logprobs = self._logprobs([event.token_id], [event.logprob], [event.top_logprobs])
        elif completion is not None:
            text, reason = completion.text, completion.finish_reason
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, completion.top_logprobs)
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        if self.return_ids and event is not None:
            choice["token_ids"] = [event.token_id]
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        }

    def usage_chunk(self, results: list[tuple[Completion, ...]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(results),
        }

    @staticmethod
    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
