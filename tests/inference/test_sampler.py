"""Samplers (submit -> future) and weight syncs, on a fake engine: no model needed.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/inference/test_sampler.py -q
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from rollout.inference.sampler import BatchingSampler, EngineSampler, QueueFull
from rollout.inference.types import Completion, GenerationError, GenerationRequest, SamplingParams
from rollout.inference.weight_sync import DiskReloadWeightSync, InProcessWeightSync


class FakeEngine:
    """Answers each request with its prompt reversed; records every generate call."""

    model_name = "fake"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.threads: list[str] = []
        self.updates: list[object] = []
        self.fail = fail

    @property
    def weights_version(self) -> int:
        return len(self.updates)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams | None = None):
        self.calls.append([str(r.prompt) for r in requests])
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise GenerationError("boom")
        return [(Completion(0, str(r.prompt)[::-1], (1,), (-0.5,), "stop", 1, 1),) for r in requests]

    def update_weights(self, weights: object) -> int:
        self.updates.append(weights)
        return len(self.updates)

    def close(self) -> None:
        pass


def requests(*prompts: str) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p) for p in prompts]


def test_engine_sampler_runs_requests_that_arrive_together_as_one_call_off_the_loop() -> None:
    engine = FakeEngine()

    async def main() -> list[str]:
        sampler = EngineSampler(engine, max_batch=8)
        futures = sampler.submit_all(requests("ab", "cd", "ef"))  # the call starts now, on a worker thread
        outs = await asyncio.gather(*futures)
        single = await sampler.submit(requests("xy")[0])
        return [c[0].text for c in [*outs, single]]

    assert asyncio.run(main()) == ["ba", "dc", "fe", "yx"]
    assert engine.calls == [["ab", "cd", "ef"], ["xy"]]
    assert all(name != threading.current_thread().name for name in engine.threads)


def test_engine_sampler_failures_reach_every_future() -> None:
    async def main() -> None:
        futures = EngineSampler(FakeEngine(fail=True), max_batch=8).submit_all(requests("a", "b"))
        for future in futures:
            with pytest.raises(GenerationError, match="boom"):
                await future

    asyncio.run(main())


def test_rounds_on_the_caller_thread_give_the_same_answers_there_and_their_failures() -> None:
    """`rounds_on_caller_thread` (on-policy RL with the in-process engine): `submit_all`'s one call
    runs on the event loop's own thread and its futures are done on return; errors reach every
    future as from the worker; `sample()` (multi-turn batching) stays on the worker thread."""
    engine = FakeEngine()

    async def main() -> list[str]:
        sampler = EngineSampler(engine, max_batch=8)
        sampler.rounds_on_caller_thread = True
        futures = sampler.submit_all(requests("ab", "cd", "ef"))
        assert all(f.done() for f in futures)
        outs = await asyncio.gather(*futures)
        single = (await sampler.sample("xy", SamplingParams()),)
        failing = EngineSampler(FakeEngine(fail=True), max_batch=8)
        failing.rounds_on_caller_thread = True
        for future in failing.submit_all(requests("a", "b")):
            with pytest.raises(GenerationError, match="boom"):
                await future
        return [c[0].text for c in [*outs, single]]

    assert asyncio.run(main()) == ["ba", "dc", "fe", "yx"]
    assert engine.calls == [["ab", "cd", "ef"], ["xy"]]
    assert engine.threads[0] == threading.current_thread().name
    assert engine.threads[1] != threading.current_thread().name


def test_on_policy_rounds_of_the_in_process_engine_generate_on_the_training_thread(tmp_path: Path) -> None:
    """`rl_common.generate_on_training_thread` sets `rounds_on_caller_thread` for on-policy rounds
    of an in-process engine -- single-turn rounds and multi-turn episodes alike (the episodes'
    turns are synchronous: tests/rl/test_episode.py) -- and not when pipelined or remote."""
    from types import SimpleNamespace

    from rollout.algorithms.rl_common import generate_on_training_thread

    def rollout_engine(sync: type) -> SimpleNamespace:
        engine = FakeEngine()
        weight_sync = sync(engine) if sync is InProcessWeightSync else sync(engine, tmp_path / "w")
        return SimpleNamespace(sampler=EngineSampler(engine, max_batch=4), weight_sync=weight_sync)

    local = rollout_engine(InProcessWeightSync)
    assert generate_on_training_thread(local, pipelined=False) and local.sampler.rounds_on_caller_thread
    pipelined = rollout_engine(InProcessWeightSync)
    assert not generate_on_training_thread(pipelined, pipelined=True)
    assert not pipelined.sampler.rounds_on_caller_thread
    remote = rollout_engine(DiskReloadWeightSync)
    assert not generate_on_training_thread(remote, pipelined=False) and not remote.sampler.rounds_on_caller_thread
    assert not generate_on_training_thread(SimpleNamespace(sampler=None), pipelined=False)  # a group runner


def test_batching_sampler_batches_and_refuses_what_does_not_fit() -> None:
    engine = FakeEngine()

    async def main() -> list[str]:
        sampler = BatchingSampler(engine, max_batch_size=8, max_queue=3, gather_window_s=0.05)
        with pytest.raises(QueueFull):
            sampler.submit_all(requests("a", "b", "c", "d"))  # all or nothing
        assert sampler.queue_depth == 0
        futures = sampler.submit_all(requests("ab", "cd", "ef"))
        sampler.start()
        try:
            outs = await asyncio.gather(*futures)
        finally:
            await asyncio.to_thread(sampler.stop)
        return [c[0].text for c in outs]

    assert asyncio.run(main()) == ["ba", "dc", "fe"]
    assert engine.calls == [["ab", "cd", "ef"]]  # queued together: one batch


def test_batching_sampler_is_a_sampler_too() -> None:
    """`sample` (one completion, the eval / episode seam) through the server's batcher."""
    engine = FakeEngine()

    async def main() -> str:
        sampler = BatchingSampler(engine, max_batch_size=8, max_queue=8, gather_window_s=0.0)
        sampler.start()
        try:
            completion = await sampler.sample("hello", SamplingParams(n=3, seed=1))
        finally:
            await asyncio.to_thread(sampler.stop)
        return completion.text

    assert asyncio.run(main()) == "olleh"


def test_weight_syncs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    weights = {"w": torch.ones(2), "tied": torch.zeros(3)}
    engine = FakeEngine()
    in_process = InProcessWeightSync(engine)
    in_process.push(weights, version=1)
    assert engine.updates == [weights] and not in_process.keeps_serving

    remote = FakeEngine()
    disk = DiskReloadWeightSync(remote, tmp_path / "weights")
    disk.push(weights, version=1)
    disk.push(weights, version=2)
    assert remote.updates == [str(tmp_path / "weights" / "v1"), str(tmp_path / "weights" / "v2")]
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"]  # older versions are removed
    assert (tmp_path / "weights" / "v2" / "model.safetensors").is_file() and disk.keeps_serving


def test_engine_sampler_sample_batches_concurrent_calls() -> None:
    engine = FakeEngine()

    async def main() -> list[str]:
        sampler = EngineSampler(engine, max_batch=8)
        try:
            done = await asyncio.gather(*(sampler.sample(p, SamplingParams(n=2)) for p in ("ab", "cd")))
        finally:
            sampler.close()
        return [c.text for c in done]

    assert asyncio.run(main()) == ["ba", "dc"]
    assert engine.calls == [["ab", "cd"]]  # one call for the coroutines that asked in the same turn
