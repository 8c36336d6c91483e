"""Samplers: submit a generation request, get a future; requests that arrive together run together.

    sampler = EngineSampler(engine)                      # what RL uses today
    futures = sampler.submit_all(requests)               # one engine.generate call, started at once
    outputs = await asyncio.gather(*futures)             # [(Completion, ...), ...] in request order

    sampler = BatchingSampler(engine, max_batch_size=32, max_queue=256, gather_window_s=0.005)
    sampler.start()                                      # what `rollout serve` uses
    completions = await sampler.submit(request)          # QueueFull when the queue has no room

`Sampler` is the seam the server, RL rollouts and (later) multi-turn episodes
and eval share: callers never touch the engine's threading or batching.

`EngineSampler` runs each `submit_all` as one `engine.generate` call on a
worker thread, started before `submit_all` returns (so generation overlaps
whatever the event loop does next, e.g. a training step).

`BatchingSampler` is a bounded queue in front of one engine, drained by one
worker thread that owns the engine:

- with a `ContinuousEngine` (hf) it keeps one decode session running: between
  decode steps it admits queued requests while rows are free (one prefill
  forward for all of them), and resolves each request's future the moment
  its last choice finishes; a cancelled request (client gone) leaves the batch
  at the next step;
- with any other engine it takes up to `max_batch_size` queued requests and
  calls `engine.generate` on them as one batch.

When idle, the first request waits `gather_window_s` for companions, so
requests arriving together share one forward pass. The event loop never runs
model code. `run_exclusive` stops admission, waits until no row is running and
then runs a function (a weight update) on the worker thread, so no completion
ever mixes two versions of the weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rollout.inference.types import (
    Completion,
    ContinuousEngine,
    DecodeSession,
    GenerationError,
    GenerationRequest,
    InferenceEngine,
)

log = logging.getLogger("rollout.serve")
T = TypeVar("T")
Choices = tuple[Completion, ...]
"""The `n` completions of one request."""


class QueueFull(Exception):
    """The bounded queue has no room; the caller answers 503 with Retry-After."""


class Sampler(Protocol):
    """Generation behind futures (call on the event loop)."""

    def submit(self, request: GenerationRequest) -> asyncio.Future[Choices]:
        """Queue one request; its future resolves with the request's `n` completions."""
        ...

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future[Choices]]:
        """Queue requests that arrive together (one future each, in order); they may share a batch."""
        ...


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class SamplerMetrics(Protocol):
    """What `BatchingSampler` counts (`rollout.serve.metrics.ServerMetrics` has these)."""

    batch_rows: _Histogram
    cancelled: _Counter
    prompt_tokens: _Counter
    generated_tokens: _Counter


class _NoCount:
    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


class _NoMetrics:
    batch_rows = cancelled = prompt_tokens = generated_tokens = _NoCount()


# --------------------------------------------------------------------------- one engine call per submission


class EngineSampler:
    """Each `submit_all` is one `engine.generate` call on a worker thread, started immediately."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def submit(self, request: GenerationRequest) -> asyncio.Future[Choices]:
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future[Choices]]:
        loop = asyncio.get_running_loop()
        batch = loop.run_in_executor(None, contextvars.copy_context().run, self.engine.generate, list(requests))
        futures: list[asyncio.Future[Choices]] = [loop.create_future() for _ in requests]

        def split(done: asyncio.Future[list[Choices]]) -> None:
            for i, future in enumerate(futures):
                if future.done():
                    continue
                if done.cancelled():
                    future.cancel()
                elif done.exception() is not None:
                    future.set_exception(done.exception())  # type: ignore[arg-type]
                else:
                    future.set_result(done.result()[i])

        batch.add_done_callback(split)
        return futures


# --------------------------------------------------------------------------- a bounded queue and one worker


@dataclass
class _Job:
    request: GenerationRequest
    rows: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Choices]


@dataclass
class _Control:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    queued_at: float = field(default_factory=time.monotonic)


class BatchingSampler:
    """Concurrent requests share forward passes: a bounded queue drained by one worker thread."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        max_batch_size: int,
        max_queue: int,
        gather_window_s: float,
        metrics: SamplerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.gather_window_s = gather_window_s
        self.metrics: SamplerMetrics = metrics if metrics is not None else _NoMetrics()
        self._queue: deque[_Job] = deque()
        self._controls: deque[_Control] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._active_rows = 0
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- event-loop side

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_rows(self) -> int:
        return self._active_rows

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> asyncio.Future[Choices]:
        """Queue a request (call on the event loop); raises `QueueFull` when there is no room."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future[Choices]]:
        """Queue all of `requests` or, when the queue has no room for all of them, none (`QueueFull`)."""
        loop = asyncio.get_running_loop()
        jobs = [_Job(r, r.params.n if r.params else 1, loop, loop.create_future()) for r in requests]
        with self._cond:
            if len(self._queue) + len(jobs) > self.max_queue or self._stopping:
                raise QueueFull()
            self._queue.extend(jobs)
            self._cond.notify()
        return [job.future for job in jobs]

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker thread once every running row has finished; nothing is admitted meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            self._controls.append(_Control(fn, loop, future))
            self._cond.notify()
        return await future

    # ----------------------------------------------------------------- worker thread

    def _run(self) -> None:
        session = self.engine.open_session() if isinstance(self.engine, ContinuousEngine) else None
        jobs: dict[int, _Job] = {}  # id(request) -> job, for the rows in the session
        while True:
            with self._cond:
                while not self._stopping and not self._queue and not self._controls and not self._active_rows:
                    self._cond.wait(0.5)
                if self._stopping:
                    break
            if self._controls and not self._active_rows:
                self._run_control(self._controls.popleft())
                continue
            if not self._active_rows and self._queue and self.gather_window_s > 0:
                time.sleep(self.gather_window_s)  # let companions arrive: one prefill for all of them
            admitted = [] if self._controls else self._take(self.max_batch_size - self._active_rows)
            if session is None:
                self._generate_batch(admitted)
                continue
            try:
                if admitted:
                    self._admit(session, admitted, jobs)
                if session.num_rows:
                    self.metrics.batch_rows.observe(session.num_rows)
                finished = session.step()
                self._active_rows = session.num_rows
            except Exception as err:  # a bug or an OOM: fail what is running, keep serving
                log.exception("decode step failed")
                for job in jobs.values():
                    _resolve(job.future, job.loop, error=err)
                jobs.clear()
                session = self.engine.open_session()  # type: ignore[attr-defined]
                self._active_rows = 0
                continue
            for request, completions in finished:
                job = jobs.pop(id(request), None)
                if job is not None:
                    self._count(completions)
                    _resolve(job.future, job.loop, value=completions)
        with self._cond:
            pending, self._queue = list(self._queue), deque()
        for job in [*pending, *jobs.values()]:
            _resolve(job.future, job.loop, error=GenerationError("the server is shutting down"))

    def _take(self, free_rows: int) -> list[_Job]:
        """Queued jobs that fit in `free_rows` (at least one when nothing runs); skips abandoned ones."""
        taken: list[_Job] = []
        with self._cond:
            while self._queue:
                job = self._queue[0]
                if job.future.done() or (job.request.cancel is not None and job.request.cancel.is_set()):
                    self._queue.popleft()
                    _resolve(job.future, job.loop, cancel=True)
                    continue
                if job.rows > free_rows and (taken or self._active_rows):
                    break
                self._queue.popleft()
                taken.append(job)
                free_rows -= job.rows
        return taken

    def _admit(self, session: DecodeSession, admitted: list[_Job], jobs: dict[int, _Job]) -> None:
        try:
            session.add([j.request for j in admitted])
        except GenerationError:  # one bad prompt must not sink its companions: add them one by one
            for job in admitted:
                try:
                    session.add([job.request])
                except GenerationError as err:
                    _resolve(job.future, job.loop, error=err)
                    continue
                jobs[id(job.request)] = job
        else:
            for job in admitted:
                jobs[id(job.request)] = job
        self._active_rows = session.num_rows

    def _generate_batch(self, admitted: list[_Job]) -> None:
        if not admitted:
            return
        self._active_rows = sum(j.rows for j in admitted)
        self.metrics.batch_rows.observe(self._active_rows)
        try:
            results = self.engine.generate([j.request for j in admitted])
        except Exception as err:
            log.exception("generate failed")
            for job in admitted:
                _resolve(job.future, job.loop, error=err)
        else:
            for job, completions in zip(admitted, results, strict=True):
                self._count(completions)
                _resolve(job.future, job.loop, value=completions)
        finally:
            self._active_rows = 0

    def _run_control(self, control: _Control) -> None:
        try:
            value = control.fn()
        except Exception as err:
            _resolve(control.future, control.loop, error=err)
        else:
            _resolve(control.future, control.loop, value=value)

    def _count(self, completions: tuple[Completion, ...]) -> None:
        if any(c.finish_reason == "cancelled" for c in completions):
            self.metrics.cancelled.inc()
        if completions:
            self.metrics.prompt_tokens.inc(completions[0].prompt_tokens)
        self.metrics.generated_tokens.inc(sum(c.completion_tokens for c in completions))


def _resolve(
    future: asyncio.Future[Any],
    loop: asyncio.AbstractEventLoop,
    *,
    value: Any = None,
    error: BaseException | None = None,
    cancel: bool = False,
) -> None:
    """Settle a future from the worker thread (ignoring futures nobody waits for any more)."""

    def settle() -> None:
        if future.done():
            return
        if cancel:
            future.cancel()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
        loop.call_soon_threadsafe(settle)
