"""Offline batch generation that survives `kill -9`: `rollout infer batch`.

    rollout infer batch --model local/models/sft-tiny --input prompts.jsonl --output out.jsonl \\
        --temperature 0.7 --max-tokens 64 --n 2

Input lines: `{"prompt": str | [{"role", "content"}, ...], ...extra fields}`
(checked up front, `file:line: problem`). Output: one line per sample
(input line x choice), in the order samples finish:

    {"id", "index", "choice", "prompt", "completion", "token_ids", "logprobs", "finish_reason",
     "usage": {"prompt_tokens", "completion_tokens"}, ...the input's extra fields}

`index` is the input's 0-based position among its data lines; an extra field
whose name we use is kept as `input_<name>`. A sample's `id` is a digest of
the model's identity (its files' digest, or the snapshot id), the prompt, the
sampling params and (index, choice); its seed derives from the same digest, so
a sample's tokens do not depend on batching or on how often the run resumed.

Nothing lost, nothing twice: each finished request's lines are appended and
flushed at once (and fsynced at least every second and at the end). On start
the existing output is read: complete lines whose ids belong to this run are
kept and skipped, a torn last line (a kill mid-write) is cut off, and a line
from another run (other model, prompts or params) stops us with an error
rather than being mixed in or deleted.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import blake3

from rollout.data.jsonl import read_rows
from rollout.errors import DataError
from rollout.inference.types import (
    Completion,
    GenerationRequest,
    InferenceEngine,
    Prompt,
    SamplingParams,
    derive_seed,
)
from rollout.progress import shows_progress

OUTPUT_FIELDS = (
    "id",
    "index",
    "choice",
    "prompt",
    "completion",
    "token_ids",
    "logprobs",
    "top_logprobs",
    "finish_reason",
    "usage",
    "model",
)
FSYNC_EVERY_S = 1.0


@dataclass(frozen=True)
class BatchItem:
    """One input line: its position, prompt and the fields passed through to the output."""

    index: int
    prompt: Prompt
    extra: Mapping[str, Any]


@dataclass(frozen=True)
class BatchSummary:
    total_samples: int
    already_done: int
    generated: int
    completion_tokens: int
    seconds: float


def read_batch_input(path: Path) -> list[BatchItem]:
    """Every line of `path`, checked (`DataError` naming the first bad lines)."""
    rows, _ = read_rows(Path(path), "prompt")
    return [
        BatchItem(i, row.data["prompt"], {k: v for k, v in row.data.items() if k != "prompt"})
        for i, row in enumerate(rows)
    ]


def sample_ids(identity: str, item: BatchItem, params: SamplingParams) -> tuple[str, ...]:
    """The ids of an item's `params.n` samples (32 hex chars each)."""
    return tuple(_digest(identity, item, params, choice)[:32] for choice in range(params.n))


def run_batch(
    engine: InferenceEngine,
    items: list[BatchItem],
    params: SamplingParams,
    *,
    output: Path,
    identity: str,
    batch_size: int = 256,
    include_logprobs: bool = True,
    model_name: str | None = None,
) -> BatchSummary:
    """Generate every sample not yet in `output`, appending lines as requests finish."""
    t0 = time.perf_counter()
    ids = {item.index: sample_ids(identity, item, params) for item in items}
    done = check_output(Path(output), items, params, identity=identity)
    todo = [item for item in items if not all(i in done for i in ids[item.index])]
    total = len(items) * params.n
    already = total - len(todo) * params.n
    writer = _Writer(Path(output), include_logprobs=include_logprobs, model_name=model_name)
    progress = _Progress(total, already=already)
    try:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            requests = []
            for item in chunk:

                def on_finish(completions: tuple[Completion, ...], item: BatchItem = item) -> None:
                    lines = [
                        (ids[item.index][c.index], item, c)
                        for c in completions
                        if ids[item.index][c.index] not in done
                    ]
                    writer.write(lines)
                    progress.advance(len(lines), sum(c.completion_tokens for _, _, c in lines))

                seed = derive_seed("infer-batch", _digest(identity, item, params, None))
                requests.append(
                    GenerationRequest(
                        prompt=item.prompt, params=replace(params, seed=seed), on_finish=on_finish
                    )
                )
            engine.generate(requests)
    finally:
        writer.close()
        progress.close()
    return BatchSummary(total, already, writer.lines, writer.tokens, time.perf_counter() - t0)


def check_output(output: Path, items: list[BatchItem], params: SamplingParams, *, identity: str) -> set[str]:
    """The sample ids already in `output` (see `resume_output`)."""
    expected = {i for item in items for i in sample_ids(identity, item, params)}
    return resume_output(Path(output), expected)


def resume_output(output: Path, expected: set[str]) -> set[str]:
    """The ids already in `output`; cuts a torn last line; refuses lines of another run."""
    if not output.exists():
        return set()
    done: set[str] = set()
    with output.open("r+b") as f:
        data = f.read()
        end = len(data)
        if data and not data.endswith(b"\n"):  # a kill mid-write: drop the partial line
            end = data.rfind(b"\n") + 1
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    for line_no, raw in enumerate(data[:end].splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            sample_id = json.loads(raw)["id"]
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f"{output}:{line_no}: not a line written by `rollout infer batch`",
                details=["pass a new --output, or --overwrite to start over"],
            ) from None
        if sample_id not in expected:
            raise DataError(
                f"{output}:{line_no}: sample {sample_id} is not part of this run"
                " (another model, input or sampling params wrote this file)",
                details=["pass a new --output, or --overwrite to start over"],
            )
        done.add(sample_id)
    return done


def _digest(identity: str, item: BatchItem, params: SamplingParams, choice: int | None) -> str:
    key = {
        "model": identity,
        "prompt": item.prompt,
        "params": asdict(params),
        "index": item.index,
        "choice": choice,
    }
    return blake3.blake3(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Writer:
    """Appends whole lines (one write per request), flushes each, fsyncs at least every second."""

    def __init__(self, path: Path, *, include_logprobs: bool, model_name: str | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = path.open("ab")
        self._lock = threading.Lock()  # engines may call on_finish from several threads
        self._last_sync = time.monotonic()
        self.include_logprobs = include_logprobs
        self.model_name = model_name
        self.lines = 0
        self.tokens = 0

    def write(self, samples: list[tuple[str, BatchItem, Completion]]) -> None:
        if not samples:
            return
        payload = b"".join(self._line(*s) for s in samples)
        with self._lock:
            self._file.write(payload)
            self._file.flush()
            self.lines += len(samples)
            self.tokens += sum(c.completion_tokens for _, _, c in samples)
            if time.monotonic() - self._last_sync >= FSYNC_EVERY_S:
                os.fsync(self._file.fileno())
                self._last_sync = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def _line(self, sample_id: str, item: BatchItem, c: Completion) -> bytes:
        out: dict[str, Any] = {
            "id": sample_id,
            "index": item.index,
            "choice": c.index,
            "prompt": item.prompt,
            "completion": c.text,
            "token_ids": list(c.token_ids),
        }
        if self.include_logprobs:
            out["logprobs"] = list(c.logprobs)
            if c.top_logprobs is not None:
                out["top_logprobs"] = [[[t, v] for t, v in step] for step in c.top_logprobs]
        out["finish_reason"] = c.finish_reason
        out["usage"] = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}
        if self.model_name:
            out["model"] = self.model_name
        for key, value in item.extra.items():
            out[f"input_{key}" if key in OUTPUT_FIELDS else key] = value
        return (json.dumps(out, ensure_ascii=False) + "\n").encode("utf-8")


class _Progress:
    """A rich bar on a TTY (stderr); otherwise a plain line every ~5%."""

    def __init__(self, total: int, *, already: int) -> None:
        self.total, self.done = total, already
        self.tokens = 0
        self._t0 = time.perf_counter()
        self._every = max(1, total // 20)
        self._next_report = already + self._every
        self._bar: Any = None
        self._lock = threading.Lock()
        self._shown = shows_progress()
        if self._shown and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]infer"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._bar.start()
            self._task = self._bar.add_task("infer", total=total, completed=already, info="")
        elif self._shown and already:
            print(f"resuming: {already}/{total} samples already in the output", file=sys.stderr, flush=True)

    def advance(self, samples: int, tokens: int) -> None:
        with self._lock:
            self.done += samples
            self.tokens += tokens
            rate = self.tokens / max(time.perf_counter() - self._t0, 1e-9)
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, info=f"{rate:.0f} tok/s")
            elif self._shown and (self.done >= self._next_report or self.done == self.total):
                self._next_report = self.done + self._every
                print(
                    f"samples={self.done}/{self.total} tokens_per_s={rate:.1f}", file=sys.stderr, flush=True
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
