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

This is the seed of DESIGN.md's `inference/sampler.py`; `serve/batcher.py` (continuous
batching into a running decode session) can later sit behind the same `sample` call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

from rollout.errors import ConfigError
from rollout.inference.types import (
    Completion,
    GenerationError,
    GenerationRequest,
    InferenceEngine,
    Prompt,
    SamplingParams,
)


class Sampler(Protocol):
    """Anything that turns one prompt into one completion, asynchronously."""

    async def sample(self, prompt: Prompt, params: SamplingParams) -> Completion:
        """One completion (`params.n` is ignored: one choice); `SampleFailed` when it can't be produced."""
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

    async def sample(self, prompt: Prompt, params: SamplingParams) -> Completion:
        failures, solo = 0, False
        while True:
            try:
                return await self._submit(prompt, params, solo=solo)
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

    def _submit(self, prompt: Prompt, params: SamplingParams, *, solo: bool) -> asyncio.Future[Completion]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        request = GenerationRequest(prompt=prompt, params=params if params.n == 1 else _one(params))
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


def _one(params: SamplingParams) -> SamplingParams:
    return replace(params, n=1)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """Hand a finished job back to the loop; a loop already closed (the caller gave up) has no one waiting."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
