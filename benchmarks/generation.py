"""Generation throughput: naive `model.generate` loop vs batched `model.generate` vs rollout's hf engine vs `rollout serve`.

    .venv/bin/python benchmarks/generation.py                          # default: tiny + ~48M model, ~3 min on 2 cores
    .venv/bin/python benchmarks/generation.py --models tiny            # tiny only, under a minute
    .venv/bin/python benchmarks/generation.py --prompts 64 --max-tokens 128 --threads 2

For each model (the 1.05M-parameter tiny Qwen2 and a ~48M random Qwen2, both
made locally with `init_tiny_model` and cached under `--work-dir`) it prints
generated tokens per second for

  (a) naive:   `model.generate` called on one prompt at a time, in a loop;
  (b) batched: `model.generate` on all prompts at once (left padding, KV cache);
  (c) engine:  `HFEngine.generate` on all prompts (our decode loop, continuous batching);
  (d) server:  `rollout serve` in a subprocess, hit by 1, 8 and 32 concurrent clients, each sending
               /v1/completions requests back to back over HTTP (one prompt per request);

with the ratios engine / naive and server@32 / server@1. Every method samples
(temperature 1, no top-k / top-p) exactly `--max-tokens` tokens per prompt
(eos suppressed: `min_new_tokens` for `generate`, `ignore_eos` for rollout), so
they all produce the same number of tokens; tokens/s = generated tokens / wall
seconds of the timed section. Model loading and one warm-up call per method are
outside the timed section. The server's numbers include HTTP, JSON and
tokenization on the same 2-core machine as the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench_common import MODEL_SIZES as MODELS
from bench_common import add_precision_args, torch_dtype

CONCURRENCY = (1, 8, 32)


@dataclass(frozen=True)
class Result:
    model: str
    method: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", default="tiny,mid", help="comma-separated subset of tiny,mid,large (default tiny,mid)"
    )
    p.add_argument("--prompts", type=int, default=32, help="prompts for (a)-(c) (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--mid-prompts", type=int, default=16, help="prompts for mid/large (default 16)")
    p.add_argument("--mid-max-tokens", type=int, default=16, help="tokens per prompt, mid/large (default 16)")
    p.add_argument("--no-server", action="store_true", help="leave out (d), the server")
    add_precision_args(p)
    p.add_argument(
        "--requests-per-client", type=int, default=2, help="server: requests per client (default 2)"
    )
    p.add_argument(
        "--single-client-requests", type=int, default=6, help="server: requests of the 1-client run"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, everywhere (default 1)")
    p.add_argument("--work-dir", type=Path, default=Path("local/bench-generation"), help="model cache folder")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in MODELS for m in args.models):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    return args


def make_model(work: Path, name: str) -> Path:
    from rollout.models.tiny import init_tiny_model

    out = work / name
    if not (out / "config.json").is_file():
        init_tiny_model(out, force=True, **MODELS[name])
    return out


def make_prompts(count: int) -> list[str]:
    """Arithmetic questions and short sentences of varied length (3 to ~20 tokens)."""
    words = [
        "the",
        "model",
        "reads",
        "each",
        "number",
        "and",
        "then",
        "answers",
        "the",
        "question",
        "carefully",
    ]
    return [
        f"What is {i % 10}+{i // 10 % 10}?" if i % 2 else " ".join(words[: 2 + i % 10]) for i in range(count)
    ]


def count_params(model_dir: Path) -> float:
    from rollout.models.tiny import count_saved_parameters

    return count_saved_parameters(model_dir) / 1e6


# --------------------------------------------------------------------------- (a), (b): transformers


def bench_hf_generate(
    model_dir: Path, prompts: list[str], max_tokens: int, args: argparse.Namespace, *, batched: bool
) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(args), attn_implementation="sdpa")
        .to(args.device)
        .eval()
    )
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=tok.pad_token_id,
    )

    def run(batch: list[str]) -> int:
        enc = tok(batch, return_tensors="pt", padding=True).to(args.device)
        with torch.inference_mode():
            out = model.generate(**enc, **kwargs)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return int((out.shape[1] - enc["input_ids"].shape[1]) * len(batch))

    torch.manual_seed(0)
    run(prompts[:2] if batched else prompts[:1])  # warm-up
    t0 = time.perf_counter()
    tokens = run(prompts) if batched else sum(run([p]) for p in prompts)
    return tokens, time.perf_counter() - t0


# --------------------------------------------------------------------------- (c): rollout's engine


def bench_engine(
    model_dir: Path, prompts: list[str], max_tokens: int, args: argparse.Namespace
) -> tuple[int, float]:
    from rollout.inference import SamplingParams
    from rollout.inference.hf_engine import load_hf_engine

    engine = load_hf_engine(
        model_dir, dtype=args.dtype, device=args.device, max_batch_size=max(32, len(prompts))
    )
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], params)  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(c.completion_tokens for cs in results for c in cs), seconds


# --------------------------------------------------------------------------- (d): the server


def start_server(model_dir: Path, threads: int) -> tuple[subprocess.Popen[str], str]:
    rollout = Path(sys.executable).parent / "rollout"
    cmd = [str(rollout)] if rollout.exists() else [sys.executable, "-m", "rollout.cli.main"]
    cmd += [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--threads",
        str(threads),
        "--max-batch-size",
        "32",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving NAME on http://127.0.0.1:PORT/v1 (...)"
    match = re.search(r"serving (\S+) on (http://\S+/v1)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"rollout serve did not start: {line!r}")
    return proc, match.group(2)


async def _client_load(
    base_url: str, model: str, prompts: list[str], max_tokens: int, clients: int, per_client: int,
    *, ignore_eos: bool = True,
) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `clients` concurrent clients sending `per_client`
    /v1/completions requests each, back to back, after one warm-up request. `ignore_eos=False`
    leaves the field out (a server that refuses it, `transformers serve`): the tokens counted are
    the server's own `usage.completion_tokens` either way."""
    import httpx

    async def one_client(http: httpx.AsyncClient, c: int) -> int:
        tokens = 0
        for r in range(per_client):
            body = {
                "model": model,
                "prompt": prompts[(c * per_client + r) % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": c * 1000 + r,
                **({"ignore_eos": True} if ignore_eos else {}),
            }
            response = await http.post(f"{base_url}/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await one_client(http, 0)  # warm-up (not timed)
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one_client(http, c) for c in range(clients)))
        return sum(tokens), time.perf_counter() - t0


def start_transformers_server(model_dir: Path, threads: int, *, timeout_s: float = 180.0) -> tuple[subprocess.Popen[str], str]:
    """`transformers serve MODEL --continuous-batching` (paged attention, its batching scheduler) on
    a free local port, `threads` OpenMP threads; returns once /health answers."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = Path(sys.executable).parent / "transformers"
    cmd = [str(cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--continuous-batching"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"transformers serve did not answer /health within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench_server(
    model_dir: Path, prompts: list[str], max_tokens: int, args: argparse.Namespace
) -> dict[int, tuple[int, float]]:
    proc, base_url = start_server(model_dir, args.threads)
    try:
        out = {}
        for clients in CONCURRENCY:
            per_client = args.single_client_requests if clients == 1 else args.requests_per_client
            out[clients] = asyncio.run(
                _client_load(base_url, model_dir.name, prompts, max_tokens, clients, per_client)
            )
        return out
    finally:
        stop_server(proc)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print(
        f"generation benchmark: torch {torch.__version__}, {args.threads} thread(s), cpu count {os.cpu_count()}, "
        f"{args.device} {args.dtype},"
        " sampling at temperature 1, eos suppressed; tokens/s = generated tokens / wall seconds",
        flush=True,
    )
    results: list[Result] = []
    for name in args.models:
        model_dir = make_model(args.work_dir, name)
        count = args.prompts if name == "tiny" else args.mid_prompts
        max_tokens = args.max_tokens if name == "tiny" else args.mid_max_tokens
        prompts = make_prompts(count)
        label = f"{name} ({count_params(model_dir):.2f}M params, {count} prompts x {max_tokens} tokens)"
        print(f"\n== {label}", flush=True)
        for method, fn in (
            ("(a) naive model.generate loop", partial(bench_hf_generate, batched=False)),
            ("(b) model.generate, whole batch", partial(bench_hf_generate, batched=True)),
            ("(c) rollout hf engine", bench_engine),
        ):
            tokens, seconds = fn(model_dir, prompts, max_tokens, args)
            results.append(Result(name, method, tokens, seconds))
            print(
                f"  {method:<34} {tokens:>6} tokens {seconds:>8.2f} s {tokens / seconds:>9.1f} tok/s",
                flush=True,
            )
        served = {} if args.no_server else bench_server(model_dir, prompts, max_tokens, args)
        for clients, (tokens, seconds) in served.items():
            method = f"(d) server, {clients} client{'s' if clients > 1 else ''}"
            results.append(Result(name, method, tokens, seconds))
            print(
                f"  {method:<34} {tokens:>6} tokens {seconds:>8.2f} s {tokens / seconds:>9.1f} tok/s",
                flush=True,
            )
    print_summary(results)


def print_summary(results: list[Result]) -> None:
    print("\n| model | method | tokens | seconds | tokens/s |\n|---|---|---:|---:|---:|")
    for r in results:
        print(f"| {r.model} | {r.method} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_s:.1f} |")
    print()
    for model in dict.fromkeys(r.model for r in results):
        by = {
            r.method[:3] + (r.method.split(",")[1].strip() if "server" in r.method else ""): r.tokens_per_s
            for r in results
            if r.model == model
        }
        naive, batched, engine = by["(a)"], by["(b)"], by["(c)"]
        if "(d)1 client" not in by:
            print(
                f"{model}: engine / naive loop = {engine / naive:.1f}x; "
                f"engine / batched generate = {engine / batched:.2f}x"
            )
            continue
        one, many = by["(d)1 client"], by["(d)32 clients"]
        print(
            f"{model}: engine / naive loop = {engine / naive:.1f}x (target >= 3x); "
            f"engine / batched generate = {engine / batched:.2f}x; "
            f"server@32 / server@1 = {many / one:.1f}x (target >= 5x); server@8 / server@1 = {by['(d)8 clients'] / one:.1f}x"
        )


if __name__ == "__main__":
    main()
