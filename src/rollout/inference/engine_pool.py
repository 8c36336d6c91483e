"""Several engines as one: `[inference] engine = "openai"` with `base_urls = [...]` (a few `rollout serve`
or vLLM servers), load-balanced by pull.

    pool = EnginePool([OpenAIEngine(base_url=u, model_name="tiny", max_retries=0) for u in urls],
                      names=urls, concurrency=16)
    pool.generate(requests, SamplingParams(seed=7))    # each request on whichever engine is free first
    pool.update_weights("run/weights/v3")              # every live engine loads them, or leaves the pool

A batch's requests wait in one queue; each engine runs `concurrency` workers
that take the next request when they are free, so a fast server takes more
than a slow one and nothing waits behind a straggler (work stealing, as the Ray
rollout workers do). A request whose engine did not answer (`EngineUnreachable`:
connection refused or lost, timeout, 408/409/429/5xx) goes back to the queue
for another engine, at most `max_attempts` times, and that engine rests for
`cooldown_s` (doubling while it keeps failing, up to 60 s) before it takes work
again; a request the engine refused (any other error, e.g. a 400 for a prompt
that is too long) fails the batch at once, as it would fail anywhere. A
request's completion is taken from the first engine that answers; sampling is
seeded per request (`SamplingParams.seed`), so which server ran it does not
change its tokens.

Weights: `update_weights` sends the folder to every engine still in the pool,
in parallel. An engine that fails to load them leaves the pool for good (it
would sample with old weights: never allowed); the update fails only when no
engine took it. `stats()` counts, per engine, requests served, failures, and
whether it is out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os import PathLike
from typing import Any

from rollout.inference.types import (
    Completion,
    EngineUnreachable,
    GenerationError,
    GenerationRequest,
    InferenceEngine,
    PromptLike,
    SamplingParams,
    StateDict,
    as_request,
)

MAX_COOLDOWN_S = 60.0


@dataclass
class _Member:
    engine: InferenceEngine
    name: str
    served: int = 0
    failures: int = 0
    streak: int = 0  # failures since its last answer
    resting_until: float = 0.0
    out: str | None = None  # why it left the pool (weights it could not load)


@dataclass
class _Item:
    index: int
    request: GenerationRequest
    attempts: int = 0
    tried: str = ""


class EnginePool:
    """Engines behind one `InferenceEngine`: pulled from by free workers, failed requests re-queued."""

    def __init__(
        self, engines: Sequence[InferenceEngine], *, names: Sequence[str], concurrency: int = 16,
        max_attempts: int = 3, cooldown_s: float = 2.0, on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        if not engines or len(engines) != len(names):
            raise ValueError("an engine pool needs engines, one name each")
        self.members = [_Member(e, n) for e, n in zip(engines, names, strict=True)]
        self.model_name = engines[0].model_name
        self.concurrency, self.max_attempts, self.cooldown_s = concurrency, max_attempts, cooldown_s
        self.on_event = on_event
        self._lock = threading.Lock()
        self._version = 0
        self._executor = ThreadPoolExecutor(max_workers=concurrency * len(engines), thread_name_prefix="rollout-pool")

    @property
    def weights_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[PromptLike], params: SamplingParams | None = None) -> list[tuple[Completion, ...]]:
        default = params or SamplingParams()
        queue = deque(_Item(i, as_request(r)) for i, r in enumerate(requests))
        results: list[tuple[Completion, ...] | None] = [None] * len(queue)
        failed: list[BaseException] = []
        done = threading.Condition(self._lock)
        remaining = [len(queue)]

        def worker(member: _Member) -> None:
            while True:
                with done:  # stay until the batch is done: a request in flight elsewhere may come back
                    if failed or not remaining[0] or member.out:
                        return
                    wait = member.resting_until - time.monotonic()
                    if wait > 0 or not queue:
                        done.wait(wait if wait > 0 else 1.0)
                        continue
                    item = queue.popleft()
                try:
                    completions = member.engine.generate([item.request], item.request.params or default)[0]
                except EngineUnreachable as err:
                    with done:
                        member.failures += 1
                        member.streak += 1
                        member.resting_until = time.monotonic() + min(
                            MAX_COOLDOWN_S, self.cooldown_s * 2 ** (member.streak - 1))
                        item.attempts += 1
                        item.tried = str(err)
                        if item.attempts >= self.max_attempts:
                            failed.append(GenerationError(
                                f"request {item.index} failed on {item.attempts} attempts; last: {err}"))
                        else:
                            queue.appendleft(item)
                        done.notify_all()
                    self._event("engine_unreachable", engine=member.name, error=str(err)[:300],
                                request=item.index, attempt=item.attempts)
                    continue
                except Exception as err:  # the request was refused: it would fail on any engine
                    with done:
                        failed.append(err)
                        done.notify_all()
                    return
                with done:
                    member.served += 1
                    member.streak = 0
                    results[item.index] = completions
                    remaining[0] -= 1
                    done.notify_all()

        live = [m for m in self.members if not m.out]
        if not live:
            raise GenerationError("no engine left in the pool: " + "; ".join(f"{m.name}: {m.out}" for m in self.members))
        futures = [self._executor.submit(worker, m) for m in live for _ in range(self.concurrency)]
        for f in futures:
            f.result()
        if failed:
            raise failed[0] if isinstance(failed[0], GenerationError) else GenerationError(str(failed[0]))
        if remaining[0]:  # every worker stopped with work left: cannot happen unless the pool emptied
            raise GenerationError(f"{remaining[0]} requests were not generated (no engine left in the pool)")
        return [r for r in results if r is not None]

    def update_weights(self, weights: StateDict | str | PathLike[str]) -> int:
        """Every engine in the pool loads `weights`; one that cannot leaves the pool."""
        live = [m for m in self.members if not m.out]

        def update(member: _Member) -> BaseException | None:
            try:
                member.engine.update_weights(weights)
            except Exception as err:
                return err
            return None

        errors = list(self._executor.map(update, live))
        for member, err in zip(live, errors, strict=True):
            if err is not None:
                member.out = f"could not load weights version {self._version + 1}: {err}"
                self._event("engine_left_pool", engine=member.name, reason=member.out[:300])
        if all(e is not None for e in errors):
            raise GenerationError("no engine of the pool loaded the new weights: " + "; ".join(str(e) for e in errors))
        with self._lock:
            self._version += 1
            return self._version

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per engine: requests served, failed attempts, and why it left the pool (None: in it)."""
        with self._lock:
            return {m.name: {"served": m.served, "failures": m.failures, "out": m.out} for m in self.members}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for m in self.members:
            m.engine.close()

    def _event(self, name: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(name, fields)
