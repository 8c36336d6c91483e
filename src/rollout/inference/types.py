"""Inference data types and the `InferenceEngine` protocol (SPEC section 8).

Everything an engine takes and returns is a frozen dataclass here; engines
(`hf_engine.py`, `openai_engine.py`, `vllm_engine.py`) implement the protocol.
No torch at module level: the CLI, the config and the server import this.

    engine.generate(["What is 3+8?", [{"role": "user", "content": "hi"}]],
                    SamplingParams(temperature=0.7, max_tokens=32, n=4, seed=1))
    -> [(Completion, Completion, Completion, Completion), (Completion, ...)]

Log-probs: `Completion.logprobs[i]` is log p(token_i | prefix) under the
model's *unfiltered, temperature-1* distribution (log-softmax of the raw
logits), whatever temperature / top-k / top-p was used to sample. That is the
quantity RL's importance ratio and KL terms need, and it equals a
teacher-forced forward pass of the same weights over prompt + completion.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rollout.errors import ConfigError, RolloutError

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "cancelled"]
Message = Mapping[str, str]
"""A chat message: {"role": "user" | "assistant" | "system" | ..., "content": str}."""
Prompt = str | Sequence[Message]
"""A raw text prompt, or a list of chat messages rendered with the tokenizer's chat template."""


class GenerationError(RolloutError):
    """A request can't be generated (prompt too long, empty prompt, engine unreachable, ...)."""


class EngineUnavailable(GenerationError):
    """The engine (or its optional dependency) is not available on this machine."""


class EngineUnreachable(GenerationError):
    """A remote engine did not answer (connection refused or lost, timeout, 408/429/5xx): the
    request itself may be fine, and another engine of a pool may take it (`EnginePool`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Filtering order: temperature, then top-k, then top-p (like vLLM and HF).

    temperature 0 means greedy (argmax). `seed` fixes the tokens: choice `j` of a
    request samples from its own generator seeded with (seed, j), so the same
    seed gives the same completion whether the request runs alone or in a batch.
    `seed=None` draws a fresh random seed per request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    """Stop strings: the completion ends at the first one, which is cut from the text (like OpenAI)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a completion (kept in `token_ids`, like eos)."""
    n: int = 1
    seed: int | None = None
    top_logprobs: int = 0
    """Also return the this-many most likely tokens (unfiltered, temperature-1) at every position."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks, fixed-length sampling)."""
    tempered_logprobs: bool = False
    """Return log-probs (and top log-probs) of the temperature-scaled distribution,
    log_softmax(logits / temperature), still before top-k/top-p: the distribution an RL
    trainer samples from and trains (the importance ratio needs both at the same
    temperature). False (the OpenAI/vLLM default): temperature 1. Greedy rows: temperature 1."""

    def __post_init__(self) -> None:
        # Lists from callers become tuples so the dataclass stays hashable and frozen in spirit.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            problems.append(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be >= 0")
        if problems:
            raise ConfigError(f"invalid sampling params: {problems[0]}", details=problems[1:])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one choice, as it is produced (streaming).

    `text` is the new text this token completes (it can be empty: a partial
    UTF-8 character, or text held back while it might still become a stop
    string). The last event of a choice has `finish_reason` set and carries
    whatever text was held back, so the events' texts concatenate to the
    completion's text.
    """

    index: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    text: str
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete `params.n` times.

    Give `prompt` (text or chat messages) or `prompt_token_ids` (already
    tokenized; used as-is). `params` overrides the params passed to `generate`.
    `tools` (OpenAI tool schemas) go to the chat template (`apply_chat_template(tools=...)`)
    or, for an endpoint, in the chat request; they need a message-list prompt.
    `on_token` (streaming) and `on_finish` are called from the engine's thread;
    setting `cancel` stops the request at the next decode step (its choices end
    with finish_reason "cancelled"). `cache_key` (one conversation's id) asks an
    engine that can to continue from the key/value cache kept under it when this
    prompt extends it, and (`keep_cache`, n = 1) to keep the finished row's cache
    under it for the next turn (`inference/kept_cache.py`); engines that can't
    ignore both.
    """

    prompt: Prompt | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    params: SamplingParams | None = None
    on_token: Callable[[TokenEvent], None] | None = field(default=None, compare=False)
    on_finish: Callable[[tuple[Completion, ...]], None] | None = field(default=None, compare=False)
    cancel: threading.Event | None = field(default=None, compare=False)
    tools: tuple[Mapping[str, Any], ...] | None = field(default=None, compare=False)
    cache_key: str | None = field(default=None, compare=False)
    keep_cache: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise GenerationError("a generation request needs exactly one of prompt or prompt_token_ids")
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))
            if self.prompt is None or isinstance(self.prompt, str):
                raise GenerationError("tools need a chat-message prompt (the template renders them)")
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


@dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    `token_ids` are every sampled token, the eos / stop token included (so
    `len(token_ids) == completion_tokens` and a teacher-forced pass reproduces
    `logprobs`); `text` is their decoding without special tokens, cut before a
    matched stop string.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    weights_version: int = 0


PromptLike = GenerationRequest | Prompt
StateDict = Mapping[str, "torch.Tensor"]


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates completions for a batch of prompts; takes new weights in place."""

    model_name: str

    @property
    def weights_version(self) -> int:
        """Starts at 0, +1 per `update_weights`."""
        ...

    def generate(
        self, requests: Sequence[PromptLike], params: SamplingParams | None = None
    ) -> list[tuple[Completion, ...]]:
        """One tuple of `n` completions per request, in request order."""
        ...

    def update_weights(self, weights: StateDict | str | PathLike[str]) -> int:
        """Load new weights (a state dict, or a folder of safetensors) without a reload; returns the new version."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DecodeSession(Protocol):
    """A running batch that requests join and leave between decode steps (continuous batching)."""

    @property
    def num_rows(self) -> int:
        """Choices being decoded now."""
        ...

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        """Prefill `requests` (one forward pass) and merge them into the running batch."""
        ...

    def step(self) -> list[tuple[GenerationRequest, tuple[Completion, ...]]]:
        """One decode step for every row; returns the requests that finished (all their choices)."""
        ...


@runtime_checkable
class LocalEngine(InferenceEngine, Protocol):
    """An engine that runs the model in this process: the server batches through it."""

    max_model_len: int

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids (chat messages through the chat template, generation prompt added)."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one token (for OpenAI-style log-prob entries)."""
        ...


@runtime_checkable
class ContinuousEngine(LocalEngine, Protocol):
    def open_session(self) -> DecodeSession: ...


def as_request(item: PromptLike) -> GenerationRequest:
    """A prompt or a request, as a request."""
    return item if isinstance(item, GenerationRequest) else GenerationRequest(prompt=item)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
