"""The `openai` engine: any OpenAI-compatible server (vLLM, SGLang, `rollout serve`) as an `InferenceEngine`.

    engine = OpenAIEngine(base_url="http://127.0.0.1:8000/v1", model_name="sft-tiny", api_key="k",
                          admin_key="admin")
    engine.generate(["What is 3+8?"], SamplingParams(max_tokens=8))
    engine.update_weights("path/to/new/model")   # POST /update_weights_from_disk (SGLang's shape)

Text prompts go to /v1/completions, message lists to /v1/chat/completions, a
batch as concurrent requests (`max_concurrency` in flight). With `token_ids`
on (the default) it asks for the exact token ids the way vLLM and `rollout
serve` return them (`return_token_ids`, `return_tokens_as_token_ids`); turn it
off for servers that reject unknown fields (api.openai.com). Log-probs are
whatever the server returns: rollout's are the unfiltered temperature-1
log-probs, or temperature-scaled ones when `SamplingParams.tempered_logprobs` asks
(sent as rollout's `tempered_logprobs` extension); vLLM's depend on its
`logprobs_mode` (start it with `--logprobs-mode processed_logprobs` to train at a
temperature other than 1 with the importance-sampling correction).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from os import PathLike
from pathlib import Path
from typing import Any

from rollout.errors import ModelError
from rollout.inference.types import (
    Completion,
    EngineUnreachable,
    FinishReason,
    GenerationError,
    GenerationRequest,
    PromptLike,
    SamplingParams,
    StateDict,
    TokenEvent,
    as_request,
)

RETRYABLE_STATUS = (408, 409, 429)  # and every 5xx: the server, not the request, failed


class OpenAIEngine:
    """Generation through an OpenAI-compatible HTTP endpoint (the official `openai` client)."""

    def __init__(
        self,
        *,
        base_url: str,
        model_name: str,
        api_key: str | None = None,
        admin_key: str | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 600.0,
        token_ids: bool = True,
        max_retries: int = 3,
    ) -> None:
        try:
            import openai
        except ImportError:  # pragma: no cover - openai is a dependency of the serve extra
            raise ModelError("the openai engine needs the `openai` package: pip install openai") from None
        self.model_name = model_name
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.token_ids = token_ids
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            timeout=timeout_s,
            max_retries=max_retries,  # the openai client's own retries (0: the caller retries)
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout-openai")
        self._version = 0
        self._version_lock = threading.Lock()

    @property
    def weights_version(self) -> int:
        return self._version

    def generate(
        self, requests: Sequence[PromptLike], params: SamplingParams | None = None
    ) -> list[tuple[Completion, ...]]:
        default = params or SamplingParams()
        reqs = [as_request(r) for r in requests]
        return list(self._pool.map(lambda r: self._generate_one(r, r.params or default), reqs))

    def update_weights(self, weights: StateDict | str | PathLike[str]) -> int:
        """Ask the server to load the weights in `weights` (a folder it can read) in place."""
        if not isinstance(weights, str | PathLike):
            raise GenerationError(
                "the openai engine syncs weights through a folder: save them (save_pretrained) and pass the path"
            )
        root = self.base_url.removesuffix("/v1")
        body = json.dumps({"model_path": str(Path(weights).resolve())}).encode()
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        request = urllib.request.Request(
            f"{root}/update_weights_from_disk", data=body, headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                answer = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            raise GenerationError(
                f"{root}/update_weights_from_disk refused: HTTP {err.code} {_error_text(err)}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            raise EngineUnreachable(f"cannot reach {root}/update_weights_from_disk: {err}") from None
        if answer.get("success") is False:
            raise GenerationError(f"{root}/update_weights_from_disk failed: {answer.get('message')}")
        with self._version_lock:
            self._version = int(answer.get("weights_version", self._version + 1))
            return self._version

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ----------------------------------------------------------------- one request

    def _generate_one(self, request: GenerationRequest, params: SamplingParams) -> tuple[Completion, ...]:
        import openai

        common: dict[str, Any] = {
            "model": self.model_name,
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
        }
        if params.stop:
            common["stop"] = list(params.stop)
        if params.seed is not None:
            common["seed"] = params.seed
        extra: dict[str, Any] = {}
        if params.top_k > 0:
            extra["top_k"] = params.top_k
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            extra["ignore_eos"] = True
        if params.tempered_logprobs and params.temperature not in (0.0, 1.0):
            extra["tempered_logprobs"] = True  # rollout serve's extension (a vLLM server ignores it)
        if self.token_ids:
            extra.update(return_token_ids=True, return_tokens_as_token_ids=True)
        try:
            if request.prompt is not None and not isinstance(request.prompt, str):
                if request.tools:
                    common["tools"] = [dict(t) for t in request.tools]
                response = self._client.chat.completions.create(
                    messages=[dict(m) for m in request.prompt],  # type: ignore[misc]
                    logprobs=True,
                    top_logprobs=params.top_logprobs,
                    extra_body=extra or None,
                    **common,
                )
                choices = [_chat_choice(c, params) for c in response.choices]
            else:
                prompt = (
                    request.prompt if request.prompt is not None else list(request.prompt_token_ids or ())
                )
                response = self._client.completions.create(
                    prompt=prompt, logprobs=max(params.top_logprobs, 0), extra_body=extra or None, **common
                )
                choices = [_text_choice(c, params) for c in response.choices]
        except (openai.APIConnectionError, openai.APITimeoutError) as err:  # (a timeout is a connection error)
            raise EngineUnreachable(f"{self.base_url}: {err}") from None
        except openai.APIStatusError as err:
            if err.status_code in RETRYABLE_STATUS or err.status_code >= 500:
                raise EngineUnreachable(f"{self.base_url}: {err}") from None
            raise GenerationError(f"{self.base_url}: {err}") from None
        except openai.APIError as err:
            raise GenerationError(f"{self.base_url}: {err}") from None
        usage = response.usage
        prompt_ids = tuple(
            _extra(response, "prompt_token_ids") or _extra(response.choices[0], "prompt_token_ids") or ()
        )
        if not prompt_ids and request.prompt_token_ids:
            prompt_ids = request.prompt_token_ids
        prompt_tokens = usage.prompt_tokens if usage is not None else len(prompt_ids)
        completions = tuple(
            Completion(
                index=index,
                text=text,
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(ids) if ids else len(logprobs),
                prompt_token_ids=prompt_ids,
                top_logprobs=top,
                weights_version=self._version,
            )
            for index, text, ids, logprobs, reason, top in sorted(choices, key=lambda c: c[0])
        )
        if request.on_token is not None:  # no streaming here: one event per choice with the whole text
            for c in completions:
                request.on_token(
                    TokenEvent(
                        c.index,
                        c.token_ids[-1] if c.token_ids else -1,
                        c.logprobs[-1] if c.logprobs else 0.0,
                        (),
                        c.text,
                        c.finish_reason,
                    )
                )
        if request.on_finish is not None:
            request.on_finish(completions)
        return completions


_Choice = tuple[
    int,
    str,
    tuple[int, ...],
    tuple[float, ...],
    FinishReason,
    tuple[tuple[tuple[int, float], ...], ...] | None,
]


def _chat_choice(choice: Any, params: SamplingParams) -> _Choice:
    content = (choice.logprobs.content or []) if choice.logprobs is not None else []
    ids = _extra(choice, "token_ids") or [_token_id(e.token) for e in content]
    top = (
        tuple(tuple((_token_id(t.token), t.logprob) for t in e.top_logprobs) for e in content)
        if params.top_logprobs
        else None
    )
    return (
        choice.index,
        choice.message.content or "",
        _ids(ids),
        tuple(e.logprob for e in content),
        _reason(choice.finish_reason),
        top,
    )


def _text_choice(choice: Any, params: SamplingParams) -> _Choice:
    lp = choice.logprobs
    tokens = list(lp.tokens or []) if lp is not None else []
    ids = _extra(choice, "token_ids") or [_token_id(t) for t in tokens]
    logprobs = tuple(float(x) for x in (lp.token_logprobs or [])) if lp is not None else ()
    top = None
    if params.top_logprobs and lp is not None and lp.top_logprobs:
        top = tuple(tuple((_token_id(t), float(v)) for t, v in (d or {}).items()) for d in lp.top_logprobs)
    return (choice.index, choice.text, _ids(ids), logprobs, _reason(choice.finish_reason), top)


def _token_id(token: str) -> int:
    """`token_id:123` (vLLM's `return_tokens_as_token_ids`) -> 123; anything else -> -1."""
    if token.startswith("token_id:"):
        try:
            return int(token.removeprefix("token_id:"))
        except ValueError:
            return -1
    return -1


def _ids(ids: Sequence[int]) -> tuple[int, ...]:
    return () if any(i < 0 for i in ids) else tuple(int(i) for i in ids)


def _reason(reason: str | None) -> FinishReason:
    return "length" if reason == "length" else "stop"


def _extra(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
        return str(body.get("error", {}).get("message") or body.get("message") or body)
    except (ValueError, AttributeError):
        return err.reason or ""
