"""An async sampler over any `InferenceEngine`: coroutines ask for one completion each, it batches them.

    sampler = EngineSampler(engine, max_batch=128, max_in_flight=1)          # hf: big batches, one at a time
    sampler = EngineSampler(engine, max_batch=1, max_in_flight=16)           # openai: 16 requests in flight
    completion = await sampler.sample([{"role": "user", "content": "hi"}], SamplingParams(seed=7))
    sampler.close()

Engines are synchronous and batched (`engine.generate(requests)`); episodes are
async and want one completion at a time. The sampler sits between them: each
`sample` call queues one request; a dispatcher takes up to `max_batch` queued
requests per `engine.generate` call, with at most `max_in_flight` calls running
at once on worker threads (the event loop never runs model or network code).
Requests queued in the same event-loop turn share a batch.

Failures: a `GenerationError` (endpoint error, timeout, unreachable server) is
retried with exponential backoff (`RetryPolicy`); when every attempt failed,
`sample` raises `SampleFailed`. A batch that fails as a whole is not held
against its requests: each is retried alone, so one bad request can't sink its
neighbours. Any other exception is a bug and reaches every caller of its batch.

Whole requests (n choices each, their own seeds) go through the lower-level
`RequestSampler` seam: `submit(request)` / `submit_all(requests)` -> futures of
each request's `n` completions. `EngineSampler.submit_all` runs requests that
arrive together as one `engine.generate` call started at once (RL rollout
rounds: one call per round, so a seed pins a group's tokens).

`BatchingSampler` is the server's: a bounded queue in front of one engine,
drained by one worker thread that owns the engine:

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
ever mixes two versions of the weights. It implements `sample` too, so eval
and episodes can run against a server's batcher.

One module of ~530 lines: the two seams and both samplers behind them, read
together (they share the request types, futures and worker-thread rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from rollout.errors import ConfigError
from rollout.inference.types import (
    Completion,
    ContinuousEngine,
    DecodeSession,
    GenerationError,
    GenerationRequest,
    InferenceEngine,
    Prompt,
    SamplingParams,
)

log = logging.getLogger("rollout.serve")
T = TypeVar("T")
Choices = tuple[Completion, ...]
"""The `n` completions of one request."""
Tools = Sequence[Mapping[str, Any]] | None


class Sampler(Protocol):
    """Anything that turns one prompt into one completion, asynchronously."""

    async def sample(self, prompt: Prompt, params: SamplingParams, *, tools: Tools = None) -> Completion:
        """One completion (`params.n` is ignored: one choice); `SampleFailed` when it can't be produced.
        `tools` (OpenAI tool schemas) are rendered by the chat template / sent to the endpoint."""
        ...


class RequestSampler(Protocol):
    """Whole requests behind futures (call on the event loop)."""

    def submit(self, request: GenerationRequest) -> asyncio.Future[Choices]:
        """Queue one request; its future resolves with the request's `n` completions."""
        ...

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future[Choices]]:
        """Queue requests that arrive together (one future each, in order); they may share a batch."""
        ...


class SampleFailed(GenerationError):
    """Every attempt at one request failed; the message ends with the last error."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing request is retried.

    Attempt a (1-based) that fails waits `min(max_backoff_s, backoff_s * 2**(a-1))` before
    attempt a+1; after `max_attempts` failed attempts the request fails for good.
    """

    max_attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ConfigError("backoff times must be >= 0")

    def delay_s(self, failures: int) -> float:
        """The wait after the `failures`-th failed attempt."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))


class _BatchFailed(Exception):
    """The batch holding this request failed as a whole: retry the request alone (not an attempt)."""


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[Completion]
    solo: bool


class EngineSampler:
    """Batches concurrent `sample` calls into `engine.generate` calls on worker threads."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        max_batch: int,
        max_in_flight: int = 1,
        retry: RetryPolicy | None = None,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ConfigError(f"max_batch and max_in_flight must be >= 1, got {max_batch}, {max_in_flight}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.retry = retry or RetryPolicy()
        self.retries = 0
        """Attempts that failed and were tried again (for reporting)."""
        self._queue: deque[_Pending] = deque()
        self._in_flight = 0
        self._scheduled = False
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="rollout-sampler")
        self.rounds_on_caller_thread = False
        """`submit_all` calls `engine.generate` on the calling (event loop) thread instead of a worker
        thread. For an in-process engine whose rounds nothing else runs beside (on-policy RL): torch's
        OpenMP runtime gives every thread that computes its own team of intra-op threads, and two
        teams on the cores take turns waking each other up -- at 2 threads on 2 cores the tiny
        model's generation took 45 ms on a worker thread and 20 ms on the training thread, the
        training step after it 66 and 32 (`benchmarks/omp_teams.py`)."""

    async def sample(self, prompt: Prompt, params: SamplingParams, *, tools: Tools = None) -> Completion:
        failures, solo = 0, False
        while True:
            try:
                return await self._submit(prompt, params, solo=solo, tools=tools)
            except _BatchFailed:
                solo = True
            except GenerationError as err:
                failures += 1
                if failures >= self.retry.max_attempts:
                    raise SampleFailed(
                        f"{err} (gave up after {failures} attempts)", attempts=failures
                    ) from None
                self.retries += 1
                solo = True
                await asyncio.sleep(self.retry.delay_s(failures))

    def close(self) -> None:
        """Stop the worker threads (a `generate` call in progress finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- dispatch

    def _submit(
        self, prompt: Prompt, params: SamplingParams, *, solo: bool, tools: Tools = None
    ) -> asyncio.Future[Completion]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        request = GenerationRequest(prompt=prompt, params=params if params.n == 1 else _one(params), tools=tools)
        self._queue.append(_Pending(request, future, solo))
        if not self._scheduled:  # after the coroutines runnable now have queued theirs: they share a batch
            self._scheduled = True
            loop.call_soon(self._dispatch)
        return future

    def _dispatch(self) -> None:
        self._scheduled = False
        loop = asyncio.get_running_loop()
        while self._queue and self._in_flight < self.max_in_flight:
            batch = [self._queue.popleft()]
            while (
                not batch[0].solo and self._queue and len(batch) < self.max_batch and not self._queue[0].solo
            ):
                batch.append(self._queue.popleft())
            live = [p for p in batch if not p.future.done()]  # a caller that was cancelled needs nothing
            if not live:
                continue
            self._in_flight += 1
            job = self._pool.submit(self.engine.generate, [p.request for p in live])
            job.add_done_callback(lambda job, live=live: _call_soon(loop, self._finish, live, job))

    def _finish(self, batch: Sequence[_Pending], job: ThreadFuture[list[tuple[Completion, ...]]]) -> None:
        self._in_flight -= 1
        error = job.exception() if not job.cancelled() else GenerationError("the sampler was closed")
        for i, pending in enumerate(batch):
            if pending.future.done():
                continue
            if error is None:
                pending.future.set_result(job.result()[i][0])
            elif isinstance(error, GenerationError) and len(batch) > 1:
                pending.future.set_exception(_BatchFailed())
            else:
                pending.future.set_exception(error)
        self._dispatch()

    # ----------------------------------------------------------------- whole requests

    def submit(self, request: GenerationRequest) -> asyncio.Future[Choices]:
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[asyncio.Future[Choices]]:
        """`requests` as they are (n choices each, their own seeds) in one `engine.generate` call on a
        worker thread, started now (on this thread, done on return, with `rounds_on_caller_thread`);
        one future per request. No retries, and outside `max_batch`: an
        RL rollout round is exactly one call, whatever its size."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Choices]] = [loop.create_future() for _ in requests]
        if self.rounds_on_caller_thread:
            try:
                outputs = self.engine.generate(list(requests))
            except Exception as err:  # as from the worker thread: every request's future gets it
                for future in futures:
                    future.set_exception(err)
            else:
                for future, output in zip(futures, outputs, strict=True):
                    future.set_result(output)
            return futures
        batch = loop.run_in_executor(self._pool, self.engine.generate, list(requests))

        def split(done: asyncio.Future[list[Choices]]) -> None:
            for i, future in enumerate(futures):
                if future.done():
                    continue
                if done.cancelled():
                    future.cancel()
                elif (error := done.exception()) is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result()[i])

        batch.add_done_callback(split)
        return futures

    def release_cache(self, key_prefix: str) -> None:
        """Free the engine's kept caches under `key_prefix` (requests' `cache_key`), if it keeps any."""
        release = getattr(self.engine, "release_cache", None)
        if release is not None:
            release(key_prefix)


def _one(params: SamplingParams) -> SamplingParams:
    return replace(params, n=1)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """Hand a finished job back to the loop; a loop already closed (the caller gave up) has no one waiting."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


# --------------------------------------------------------------------------- the server's batcher


class QueueFull(Exception):
    """The bounded queue has no room; the caller answers 503 with Retry-After."""


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

    async def sample(self, prompt: Prompt, params: SamplingParams, *, tools: Tools = None) -> Completion:
        """One completion (`Sampler`): no retries; a `GenerationError` becomes `SampleFailed`."""
        try:
            choices = await self.submit(GenerationRequest(prompt=prompt, params=_one(params), tools=tools))
        except GenerationError as err:
            raise SampleFailed(str(err), attempts=1) from None
        return choices[0]

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
