"""The dashboard's HTTP app: `create_app(store, settings)` -> a read-only FastAPI app over a `Store`.

    GET /                                  the runs table (and evals); pick runs to compare
    GET /runs/{run_id}                     one run: live metric plots, snapshots, evals, events
    GET /compare?runs=A,B&metric=NAME      several runs' metric on one plot
    GET /static/...                        the page's JS and CSS, shipped in the package (works offline)

    GET /api/runs?limit=&status=           {"now", "runs": [...]}, newest first, with the latest metrics
    GET /api/runs/{id}                     the run, every metric's last value, resume_from
    GET /api/runs/{id}/metrics?since=S&name=N   {"series": {name: [[step, value], ...]}, "last_step"}
    GET /api/runs/{id}/events?after_seq=Q&limit=L&tail=1   events with seq > Q (tail: the last L)
    GET /api/runs/{id}/snapshots           with the export / resume commands to copy
    GET /api/evals?run_id=&limit=          evals with their summary metrics

The three pages are one HTML shell; `static/dashboard.js` reads the path,
fetches the API and polls it every 2 s (metrics from the last step on, events
after the last seq) while the run is not finished, drawing SVG line charts
itself. Run ids are a ULID or a unique prefix of >= 10 of its characters:
anything else is 400, an unknown or ambiguous id is 404.

Auth: with an API key every `/api` request needs `Authorization: Bearer KEY`
(compared in constant time), else 401. The pages and assets hold no data and
are served without it; the page takes the key from the URL fragment
(`/#key=KEY`, which browsers never send to a server), keeps it in the tab's
sessionStorage, and asks for it in a form when the API answers 401. When bound
to loopback the app answers only loopback Host headers, so a web page that
rebinds its DNS name to 127.0.0.1 cannot read it.

Store reads are sync SQLAlchemy: the routes are plain `def`, run in the threadpool.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from rollout.dashboard.views import (
    LISTED_METRICS,
    describe_eval,
    describe_event,
    describe_run,
    describe_run_detail,
    describe_snapshot,
    metric_series,
)
from rollout.errors import EvalNotFound, RunNotFound, SnapshotNotFound, StorageError
from rollout.store.base import RUN_STATUSES, Store

STATIC_DIR = Path(__file__).parent / "static"
# A ULID (Crockford base32) or a prefix of >= 10 characters (the time part), any case.
RUN_ID = re.compile(r"[0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{10,26}")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class DashboardSettings:
    """What the dashboard enforces and shows."""

    api_key: str | None = None  # None: no auth (bind to loopback then)
    heartbeat_timeout_s: float = 60.0  # running runs silent this long are shown as crashed
    # What the copyable `rollout snapshot export` lines add to find the store, e.g. ("--storage-path", P).
    storage_args: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # Host headers answered; None: any


def create_app(store: Store, settings: DashboardSettings | None = None) -> FastAPI:
    settings = settings or DashboardSettings()
    app = FastAPI(title="rollout dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    if settings.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts))
    app.middleware("http")(_security_headers)
    _install_error_handlers(app)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    shell = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    def index_page() -> FileResponse:
        return FileResponse(shell)

    @app.get("/runs/{run_id}", include_in_schema=False)
    def run_page(run_id: str) -> FileResponse:
        _check_run_id(run_id)
        return FileResponse(shell)

    @app.get("/compare", include_in_schema=False)
    def compare_page() -> FileResponse:
        return FileResponse(shell)

    app.include_router(_api_router(store, settings))
    return app


def _api_router(store: Store, settings: DashboardSettings) -> APIRouter:
    api = APIRouter(prefix="/api", dependencies=[Depends(_key_checker(settings.api_key))])
    timeout_s = settings.heartbeat_timeout_s

    @api.get("/runs")
    def list_runs(
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
        status: Annotated[str | None, Query()] = None,
    ) -> dict[str, object]:
        if status is not None and status not in RUN_STATUSES:
            raise HTTPException(400, f"status must be one of {', '.join(sorted(RUN_STATUSES))}")
        runs = store.list_runs(limit=limit, status=status)
        summaries = store.summarize_runs([r.id for r in runs], metric_names=LISTED_METRICS)
        now = time.time()
        return {
            "now": now,
            "runs": [describe_run(r, summaries.get(r.id), now=now, timeout_s=timeout_s) for r in runs],
        }

    @api.get("/runs/{run_id}")
    def get_run(run_id: str) -> dict[str, object]:
        run = store.get_run(_check_run_id(run_id))
        summary = store.summarize_runs([run.id], metric_names=LISTED_METRICS).get(run.id)
        final = store.final_metrics(run.id)
        return describe_run_detail(run, summary, final, now=time.time(), timeout_s=timeout_s)

    @api.get("/runs/{run_id}/metrics")
    def get_metrics(
        run_id: str,
        since: Annotated[int, Query(ge=0, description="Only steps >= this (inclusive).")] = 0,
        name: Annotated[str | None, Query(min_length=1, max_length=500, description="Only this metric.")] = None,
    ) -> dict[str, object]:
        run = store.get_run(_check_run_id(run_id))
        # The Store reads a run's metrics whole; the filter keeps the polls' responses small.
        return {"run_id": run.id, **metric_series(store.read_metrics(run.id, name=name), since=since)}

    @api.get("/runs/{run_id}/events")
    def get_events(
        run_id: str,
        after_seq: Annotated[int, Query(ge=-1)] = -1,
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
        tail: Annotated[bool, Query(description="The last `limit` events with seq > after_seq.")] = False,
    ) -> dict[str, object]:
        run = store.get_run(_check_run_id(run_id))
        if tail:
            last = _last_event_seq(store, run.id)
            if last is not None:
                after_seq = max(after_seq, last - limit)
        events = store.read_events(run.id, after_seq=after_seq, limit=limit)
        return {"run_id": run.id, "events": [describe_event(e) for e in events]}

    @api.get("/runs/{run_id}/snapshots")
    def get_snapshots(
        run_id: str, limit: Annotated[int, Query(ge=1, le=1000)] = 200
    ) -> dict[str, object]:
        run = store.get_run(_check_run_id(run_id))
        now = time.time()
        records = store.list_snapshots(run_id=run.id, limit=limit)
        return {
            "run_id": run.id,
            "snapshots": [
                describe_snapshot(r, algorithm=run.algorithm, storage_args=settings.storage_args, now=now)
                for r in records
            ],
        }

    @api.get("/evals")
    def list_evals(
        run_id: Annotated[str | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, object]:
        if run_id is not None:
            run_id = store.get_run(_check_run_id(run_id)).id
        records = store.list_evals(limit=limit, run_id=run_id)
        counts = store.count_eval_samples([e.id for e in records])
        now = time.time()
        return {
            "now": now,
            "evals": [describe_eval(e, counts.get(e.id, 0), now=now, timeout_s=timeout_s) for e in records],
        }

    return api


def _check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise HTTPException(400, "run id: expected a ULID or a prefix of >= 10 of its characters")
    return run_id.upper()


def _last_event_seq(store: Store, run_id: str) -> int | None:
    """The run's highest event seq, by about 2·log2(seq) one-row index seeks (the Store reads forward only)."""

    def any_after(seq: int) -> bool:
        return bool(store.read_events(run_id, after_seq=seq, limit=1))

    if not any_after(-1):
        return None
    low, high = -1, 1  # invariant: some event has seq > low, none has seq > high (once found)
    while any_after(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if any_after(middle) else (low, middle)
    return high


def _key_checker(key: str | None) -> Callable[[Request], None]:
    expected = hashlib.sha256(key.encode()).digest() if key is not None else None

    def check_key(request: Request) -> None:
        """Bearer auth in constant time (digests of equal length, so not even the length leaks)."""
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise HTTPException(
                401,
                "missing or wrong API key (send Authorization: Bearer <key>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check_key


async def _security_headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    response = await call_next(request)
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    if request.url.path.startswith("/api/"):
        response.headers.setdefault("Cache-Control", "no-store")
    return response


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RunNotFound)
    @app.exception_handler(EvalNotFound)
    @app.exception_handler(SnapshotNotFound)
    async def not_found(_: Request, err: StorageError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=404)

    @app.exception_handler(StorageError)
    async def storage_error(_: Request, err: StorageError) -> JSONResponse:
        # The store is unreachable or broken: say so; the page keeps polling and recovers.
        return JSONResponse({"detail": str(err)}, status_code=503)

