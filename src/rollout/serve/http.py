"""HTTP plumbing of the server: OpenAI-shaped errors, bearer auth, bounded JSON bodies, request counting."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.serve.metrics import ServerMetrics
from rollout.serve.protocol import error_body

log = logging.getLogger("rollout.serve")
BodyT = TypeVar("BodyT", bound=BaseModel)
KNOWN_PATHS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
    "/update_weights_from_disk",
    "/v1/rewards",
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = error_body(self.message, type=self.type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def check_key(request: Request, key: str | None) -> None:
    """Bearer auth, compared in constant time (digests of equal length, so not even the length leaks)."""
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = hashlib.sha256(token.strip().encode()).digest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, hashlib.sha256(key.encode()).digest()):
        raise APIError(
            401,
            "Incorrect or missing API key (send Authorization: Bearer <key>)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    return data


def parse_body(model: type[BodyT], data: Any) -> BodyT:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {first['msg']}", param=param) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return APIError(400, f"{param or 'body'}: {first.get('msg')}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return APIError(
            err.status_code, str(err.detail), type=kind, headers=dict(err.headers or {})
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=err)
        return APIError(500, "internal server error", type="server_error").response()


class CountRequests:
    """Pure ASGI middleware (streaming-safe): counts requests by endpoint and status."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_PATHS else "other"
        status = {"code": 500}

        async def send_wrapper(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
