"""The OpenAI-compatible HTTP app: `create_app(engine, settings)` -> a FastAPI app.

    GET  /v1/models                 POST /v1/completions        POST /v1/chat/completions
    GET  /health                    GET  /metrics (Prometheus)  POST /update_weights_from_disk {model_path}

Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}`:
400 for a malformed or unsupported body (FastAPI's 422 included), 401 for a
missing or wrong key, 404 for an unknown model or path, 413 for a body over
`max_body_bytes`, 503 + Retry-After when the queue is full. Generation runs on
the batching sampler's worker thread (`rollout.inference.sampler`); handlers
only parse, queue and format. A client that disconnects, streaming or not,
cancels its request, which leaves the running batch at the next decode step.

About 500 lines: the routes share one request path (prepare, queue, stream or
wait, format) whose helpers read best next to the routes that use them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.errors import ConfigError, RolloutError
from rollout.inference.sampler import BatchingSampler, QueueFull
from rollout.inference.types import (
    Completion,
    GenerationRequest,
    InferenceEngine,
    LocalEngine,
    Message,
    SamplingParams,
    TokenEvent,
)
from rollout.serve import protocol as p
from rollout.serve.http import (
    APIError,
    CountRequests,
    check_key,
    install_error_handlers,
    parse_body,
    read_json,
)
from rollout.serve.metrics import CONTENT_TYPE, ServerMetrics


@dataclass(frozen=True)
class ServerSettings:
    """What the server enforces. Keys: None disables the check (bind to loopback then)."""

    model_name: str
    api_key: str | None = None
    admin_key: str | None = None
    max_batch_size: int = 32
    max_queue: int = 256
    gather_window_s: float = 0.005
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    max_n: int = 16
    max_prompts: int = 64
    max_stop: int = 16
    retry_after_s: int = 1


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def create_app(engine: InferenceEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics()
    batcher = BatchingSampler(
        engine,
        max_batch_size=settings.max_batch_size,
        max_queue=settings.max_queue,
        gather_window_s=settings.gather_window_s,
        metrics=metrics,
    )
    metrics.watch(
        queue_depth=lambda: batcher.queue_depth,
        active_rows=lambda: batcher.active_rows,
        weights_version=lambda: engine.weights_version,
    )
    local = engine if isinstance(engine, LocalEngine) else None
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="rollout", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher, app.state.metrics, app.state.settings = batcher, metrics, settings
    app.add_middleware(CountRequests, metrics=metrics)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": settings.model_name,
            "weights_version": engine.weights_version,
            "queue_depth": batcher.queue_depth,
            "active_rows": batcher.active_rows,
        }

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request, settings.api_key)
        card: dict[str, Any] = {
            "id": settings.model_name,
            "object": "model",
            "created": started,
            "owned_by": "rollout",
        }
        if local is not None:
            card["max_model_len"] = local.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request, settings.api_key)
        body = parse_body(p.CompletionBody, await read_json(request, settings.max_body_bytes))
        _check_common(body, settings)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        prompts = body.prompts()
        if not prompts or len(prompts) > settings.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {settings.max_prompts} prompts", param="prompt")
        if (body.n or 1) * len(prompts) > settings.max_n * settings.max_prompts:
            raise APIError(400, "too many choices requested", param="n")
        top = body.logprobs
        made = [
            await _prepare(
                local,
                x,
                body,
                settings,
                max_tokens=body.max_tokens,
                top_logprobs=top or 0,
                default_max=16,
                param="prompt",
            )
            for x in prompts
        ]
        as_ids = bool(body.return_tokens_as_token_ids)
        return await _respond(
            request,
            batcher,
            metrics,
            made,
            chat=False,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=top is not None,
            as_ids=as_ids,
            return_ids=bool(body.return_token_ids),
            settings=settings,
            engine=engine,
            token_text=_token_text(local),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request, settings.api_key)
        body = parse_body(p.ChatBody, await read_json(request, settings.max_body_bytes))
        _check_common(body, settings)
        tools = _check_tools(body.tools, body.tool_choice)
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise APIError(400, 'only response_format {"type": "text"} is supported', param="response_format")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        messages: list[Message] = [{"role": m.role, "content": m.text()} for m in body.messages]
        max_tokens = body.max_completion_tokens or body.max_tokens
        made = [
            await _prepare(
                local,
                messages,
                body,
                settings,
                max_tokens=max_tokens,
                top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
                default_max=None,
                param="messages",
                tools=tools,
            )
        ]
        return await _respond(
            request,
            batcher,
            metrics,
            made,
            chat=True,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=bool(body.logprobs),
            as_ids=bool(body.return_tokens_as_token_ids),
            return_ids=bool(body.return_token_ids),
            settings=settings,
            engine=engine,
            token_text=_token_text(local),
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        if settings.admin_key is None:
            raise APIError(
                403,
                "weight updates are disabled: start the server with --admin-key (or ROLLOUT_ADMIN_KEY)",
                type="permission_error",
                code="admin_disabled",
            )
        check_key(request, settings.admin_key)
        body = parse_body(p.UpdateWeightsBody, await read_json(request, settings.max_body_bytes))
        path = Path(body.model_path)
        if not path.exists():
            raise APIError(400, f"model_path not found: {path}", param="model_path")
        try:
            version = await batcher.run_exclusive(lambda: engine.update_weights(path))
        except RolloutError as err:
            raise APIError(400, str(err), param="model_path") from None
        return {
            "success": True,
            "message": f"loaded weights from {path}",
            "weights_version": version,
            "num_paused_requests": 0,
        }

    return app


# --------------------------------------------------------------------------- request plumbing


@dataclass(frozen=True)
class _Prepared:
    prompt: str | list[Message] | None
    prompt_ids: tuple[int, ...] | None
    params: SamplingParams
    tools: tuple[dict[str, Any], ...] = ()


async def _prepare(
    local: LocalEngine | None,
    prompt: str | list[int] | list[Message],
    body: Any,
    settings: ServerSettings,
    *,
    max_tokens: int | None,
    top_logprobs: int,
    default_max: int | None,
    param: str,
    tools: list[dict[str, Any]] | None = None,
) -> _Prepared:
    """Tokenize (off the event loop: prompts can be long) to check the context; build the sampling params."""
    ids: tuple[int, ...] | None = None
    text: str | list[Message] | None = None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = tuple(prompt)  # type: ignore[arg-type]
    elif local is not None:
        try:
            if tools:  # the chat template renders them (an engine's tokenize takes them as its 2nd argument)
                ids = await asyncio.to_thread(local.tokenize, prompt, tools)  # type: ignore[arg-type,call-arg]
            else:
                ids = await asyncio.to_thread(local.tokenize, prompt)  # type: ignore[arg-type]
        except RolloutError as err:
            raise APIError(400, str(err), param=param) from None
    else:
        text = prompt  # type: ignore[assignment]
    if ids is not None and not ids:
        raise APIError(400, "the prompt is empty", param=param)
    limit = local.max_model_len if local is not None else None
    used = len(ids) if ids is not None else 0
    if max_tokens is None:
        max_tokens = default_max or settings.max_tokens_limit
        if limit is not None and default_max is None:
            max_tokens = min(max_tokens, limit - used)
    if max_tokens > settings.max_tokens_limit:
        raise APIError(
            400, f"max_tokens must be <= {settings.max_tokens_limit}, got {max_tokens}", param="max_tokens"
        )
    if limit is not None and (max_tokens < 1 or used + max_tokens > limit):
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{used + max(max_tokens, 1)} tokens ({used} in the prompt, {max(max_tokens, 1)} for the "
            "completion).",
            param=param,
            code="context_length_exceeded",
        )
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=max_tokens,
            stop=body.stop_strings(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            n=body.n or 1,
            seed=body.seed,
            top_logprobs=top_logprobs,
            ignore_eos=bool(body.ignore_eos),
            tempered_logprobs=bool(body.tempered_logprobs),
        )
    except ConfigError as err:
        raise APIError(400, str(err)) from None
    return _Prepared(text, ids, params, tuple(tools or ()))


def _check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> list[dict[str, Any]]:
    """OpenAI function tools, rendered by the chat template; calls come back as the model wrote them.

    The reply's `content` is the raw text (Hermes `<tool_call>` blocks included), as vLLM answers
    without a tool parser: clients parse it (rollout's episode loop and eval do). `tool_choice`
    "auto" / "none" only: nothing here can force a call.
    """
    if tool_choice not in (None, "none", "auto"):
        raise APIError(400, 'tool_choice must be "auto" or "none" (a call cannot be forced)', param="tool_choice")
    if not tools or tool_choice == "none":
        return []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400, 'each tool must be {"type": "function", "function": {"name": ..., ...}}', param=f"tools[{i}]"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, "function.parameters must be a JSON schema object", param=f"tools[{i}]")
    return list(tools)


def _check_common(body: p.CompletionBody | p.ChatBody, settings: ServerSettings) -> None:
    if body.model != settings.model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist (this server serves `{settings.model_name}`)",
            param="model",
            code="model_not_found",
        )
    if (body.n or 1) > settings.max_n:
        raise APIError(400, f"n must be <= {settings.max_n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    stops = body.stop_strings()
    if len(stops) > settings.max_stop or any(not s or len(s) > 256 for s in stops):
        raise APIError(
            400, f"stop takes up to {settings.max_stop} non-empty strings of <= 256 characters", param="stop"
        )


async def _respond(
    request: Request,
    batcher: BatchingSampler,
    metrics: ServerMetrics,
    made: list[_Prepared],
    *,
    chat: bool,
    stream: bool,
    include_usage: bool,
    want_logprobs: bool,
    as_ids: bool,
    return_ids: bool,
    settings: ServerSettings,
    engine: InferenceEngine,
    token_text: Callable[[int], str],
) -> Response:
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()
    cancels = [threading.Event() for _ in made]
    requests = []
    for i, m in enumerate(made):
        on_token = None
        if stream:

            def on_token(event: TokenEvent, i: int = i) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (i, event))

        requests.append(
            GenerationRequest(
                prompt=m.prompt,
                prompt_token_ids=m.prompt_ids,
                params=m.params,
                tools=m.tools if m.tools and m.prompt_ids is None else None,  # else already rendered into the ids
                on_token=on_token,
                cancel=cancels[i],
            )
        )
    futures = []
    try:
        for r in requests:
            futures.append(batcher.submit(r))
    except QueueFull:
        for c in cancels:
            c.set()
        metrics.rejected.inc()
        raise APIError(
            503,
            "the server is busy (request queue full); retry later",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    fmt = p.ResponseFormatter(
        chat=chat,
        model=settings.model_name,
        n=made[0].params.n,
        want_logprobs=want_logprobs,
        as_ids=as_ids,
        return_ids=return_ids,
        token_text=token_text,
        fingerprint=f"rollout-w{engine.weights_version}",
    )
    if stream:
        gen = _stream(fmt, futures, events, cancels, include_usage, metrics, t0)
        return StreamingResponse(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        results = await _wait_or_disconnect(request, futures, cancels)
    except ClientGone:
        return Response(status_code=499)
    except RolloutError as err:
        raise APIError(400, str(err)) from None
    metrics.latency.observe(time.perf_counter() - t0)
    return JSONResponse(fmt.response(results))


async def _wait_or_disconnect(
    request: Request, futures: list[asyncio.Future[tuple[Completion, ...]]], cancels: list[threading.Event]
) -> list[tuple[Completion, ...]]:
    gathered = asyncio.gather(*futures)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for c in cancels:
            c.set()
        raise
    finally:
        watcher.cancel()
    if gathered not in done:
        for c in cancels:
            c.set()
        gathered.cancel()
        raise ClientGone()
    return list(gathered.result())


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    fmt: p.ResponseFormatter,
    futures: list[asyncio.Future[tuple[Completion, ...]]],
    events: asyncio.Queue[tuple[int, TokenEvent | None]],
    cancels: list[threading.Event],
    include_usage: bool,
    metrics: ServerMetrics,
    t0: float,
) -> AsyncIterator[str]:
    """SSE chunks as tokens come; a client that goes away cancels its requests (the `finally`).

    Token events and "request i is done" markers share one FIFO queue; both are
    scheduled from the worker thread in order, so a request's tokens always
    precede its marker.
    """
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: events.put_nowait((i, None)))
    results: dict[int, tuple[Completion, ...]] = {}
    streamed: set[tuple[int, int]] = set()
    complete = False
    try:
        if fmt.chat:
            for j in range(len(futures) * fmt.n):
                yield fmt.sse(fmt.chunk(j, role=True))
        while len(results) < len(futures):
            i, event = await events.get()
            if event is not None:
                streamed.add((i, event.index))
                yield fmt.sse(fmt.chunk(i * fmt.n + event.index, event=event))
                continue
            future = futures[i]
            if future.cancelled() or future.exception() is not None:
                err = None if future.cancelled() else future.exception()
                yield fmt.sse(p.error_body(str(err or "cancelled"), type="server_error"))
                return
            results[i] = future.result()
            for c in results[i]:
                if (i, c.index) not in streamed:  # an engine without token streaming: send it whole
                    yield fmt.sse(fmt.chunk(i * fmt.n + c.index, completion=c))
        if include_usage:
            yield fmt.sse(fmt.usage_chunk([results[i] for i in sorted(results)]))
        yield "data: [DONE]\n\n"
        complete = True
        metrics.latency.observe(time.perf_counter() - t0)
    finally:
        if not complete:
            for c in cancels:
                c.set()


def _token_text(local: LocalEngine | None) -> Callable[[int], str]:
    if local is None:
        return lambda token_id: f"token_id:{token_id}"
    return local.token_text
