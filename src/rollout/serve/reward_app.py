"""A reward model over HTTP: `rollout serve --model <RM export>` -> `create_reward_app(rm, settings)`.

    GET  /v1/models     GET /health     GET /metrics (Prometheus)
    POST /v1/rewards    {"model": "rm-tiny", "items": [{"prompt": "What is 3+4?", "completion": "7"}, ...]}
      -> {"object": "list", "model": "rm-tiny", "data": [{"object": "reward", "index": 0, "score": 1.25}, ...],
          "usage": {"prompt_tokens": 17}}

A prompt is a text or a message list, rendered with the completion exactly as
`rollout train rm` rendered a side of its pairs (`RewardModelReward.tokenize`),
so a served score equals the in-process one. The score is raw: a trainer that
scores here (`[[algorithm.<grpo|ppo>.rewards]] kind = "reward_model"`, `url =
...`) normalises on its side, as it does in-process. `model`, when sent, must be
the served name. Errors are the OpenAI shape of the generation server
(`rollout.serve.http`): 400 for a bad body, 401 for a missing or wrong key, 404
for another model or path, 413 for a body over `max_body_bytes` or more than
`max_items` items. Scoring runs on a worker thread, one batch at a time (the
RM's forward passes take the CPU/GPU in turn anyway); requests wait their turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from rollout.rl.reward_model import RewardModelReward
from rollout.serve.http import (
    APIError,
    CountRequests,
    check_key,
    install_error_handlers,
    parse_body,
    read_json,
)
from rollout.serve.metrics import CONTENT_TYPE, ServerMetrics

REWARDS_PATH = "/v1/rewards"


@dataclass(frozen=True)
class RewardServerSettings:
    """What the reward server enforces. `api_key` None disables the check (bind to loopback then)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_items: int = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class RewardItem(_Strict):
    prompt: Annotated[str, Field(max_length=1 << 20)] | Annotated[list[_Message], Field(min_length=1)]
    completion: str


class RewardsBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are allowed, as in OpenAI's bodies
    model: str | None = Field(None, min_length=1)
    items: list[RewardItem] = Field(min_length=1)


def create_reward_app(rm: RewardModelReward, settings: RewardServerSettings) -> FastAPI:
    """The scoring app over a loaded, frozen reward model."""
    metrics = ServerMetrics()
    started = int(time.time())
    lock = asyncio.Lock()  # one batch at a time on the worker thread
    app = FastAPI(title="rollout rewards", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CountRequests, metrics=metrics)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name, "kind": "reward_model"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request, settings.api_key)
        card = {"id": settings.model_name, "object": "model", "created": started, "owned_by": "rollout",
                "kind": "reward_model", "max_model_len": rm.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post(REWARDS_PATH)
    async def rewards(request: Request) -> dict[str, Any]:
        check_key(request, settings.api_key)
        data = await read_json(request, settings.max_body_bytes)
        items = data.get("items")
        if isinstance(items, list) and len(items) > settings.max_items:
            raise APIError(413, f"{len(items)} items: at most {settings.max_items} per request",
                           param="items", code="too_many_items")
        body = parse_body(RewardsBody, data)
        if body.model is not None and body.model != settings.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server scores with"
                           f" {settings.model_name!r})", type="not_found_error", param="model", code="model_not_found")
        prompts = [i.prompt if isinstance(i.prompt, str) else [m.model_dump() for m in i.prompt] for i in body.items]
        completions = [i.completion for i in body.items]
        async with lock:
            try:
                samples = await asyncio.to_thread(rm.tokenize, prompts, completions)
                scores = await asyncio.to_thread(rm.score_samples, samples)
            except ValueError as err:  # e.g. an empty text prompt and completion: nothing to score
                raise APIError(400, str(err), param="items") from None
        return {
            "object": "list",
            "model": settings.model_name,
            "data": [{"object": "reward", "index": i, "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": sum(len(s.input_ids) for s in samples)},
        }

    return app
