"""`rollout infer batch`: offline generation over a JSONL file, resumable after any crash.

    rollout infer batch --model local/models/sft-tiny --input prompts.jsonl --output out.jsonl
    rollout infer batch --model 3f2a9c1e --input prompts.jsonl --output out.jsonl \\
        --temperature 0.8 --top-p 0.95 --max-tokens 128 --n 4 --seed 1 --stop "<|im_end|>"
    rollout infer batch --config run.toml --input prompts.jsonl --output out.jsonl   # [inference] block

Run it again after an interruption (even `kill -9`): it keeps the finished
lines and generates only the rest. Flags override the config's
`[inference]` / `[inference.sampling]` values. Only light imports here; the
inference config models and torch load after the arguments are parsed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from rollout.cli.snapshot import (
    DEFAULT_OBJECT_PATH,
    DEFAULT_STORAGE_PATH,
    ObjectPathOption,
    StoragePathOption,
)

app = typer.Typer(help="Offline inference.", no_args_is_help=True)

ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model folder or snapshot id (>= 8 hex); default: inference.model."),
]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config; its `inference` table sets engine and defaults."),
]
DtypeOption = Annotated[str | None, typer.Option("--dtype", help="float32 | bfloat16 | float16.")]
ThreadsOption = Annotated[int | None, typer.Option("--threads", min=1, help="CPU: torch intra-op threads.")]


def storage_locations(storage_path: Path | None, object_path: Path | None) -> tuple[Path, Path]:
    """Where snapshot ids are looked up: flags, then $ROLLOUT_STORAGE_PATH / $ROLLOUT_OBJECT_PATH, then ./"""
    storage = storage_path or Path(os.environ.get("ROLLOUT_STORAGE_PATH") or DEFAULT_STORAGE_PATH)
    objects = object_path or Path(os.environ.get("ROLLOUT_OBJECT_PATH") or DEFAULT_OBJECT_PATH)
    return storage, objects


@app.command("batch")
def batch(
    input_path: Annotated[Path, typer.Option("--input", "-i", help='JSONL, one {"prompt": ...} per line.')],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="JSONL to append results to (resumed if present).")
    ],
    model: ModelOption = None,
    config: ConfigOption = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="hf | openai | vllm (default: config, else hf).")
    ] = None,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="openai engine: server URL (…/v1).")
    ] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", min=0, help="0 is greedy.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Nucleus mass in (0, 1].")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=-1, help="0 or -1 disables.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Per completion.")] = None,
    n: Annotated[
        int | None, typer.Option("--n", min=1, help="Completions per prompt (one line each).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", min=0, help="Base seed (each sample derives its own).")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    stop_token_id: Annotated[
        list[int] | None, typer.Option("--stop-token-id", help="Stop token id (repeatable).")
    ] = None,
    top_logprobs: Annotated[
        int | None, typer.Option("--top-logprobs", min=0, max=20, help="Alternatives per token.")
    ] = None,
    ignore_eos: Annotated[
        bool | None, typer.Option("--ignore-eos/--no-ignore-eos", help="Generate past eos.")
    ] = None,
    logprobs: Annotated[
        bool, typer.Option("--logprobs/--no-logprobs", help="Write per-token log-probs.")
    ] = True,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", min=1, help="Sequences decoded together.")
    ] = None,
    dtype: DtypeOption = None,
    threads: ThreadsOption = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Start over: delete the output first.")
    ] = False,
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
) -> None:
    """Generate completions for every line of --input into --output (resumable)."""
    from rollout.inference.batch import check_output, read_batch_input, run_batch
    from rollout.inference.build import build_engine, resolve_engine_model
    from rollout.inference.config import load_inference_config, with_overrides
    from rollout.inference.types import SamplingParams

    cfg = with_overrides(
        load_inference_config(config),
        engine=engine,
        base_url=base_url,
        dtype=dtype,
        threads=threads,
        max_batch_size=batch_size,
        sampling={
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_tokens": max_tokens,
            "n": n,
            "seed": seed,
            "stop": stop or None,
            "stop_token_ids": stop_token_id or None,
            "top_logprobs": top_logprobs,
            "ignore_eos": ignore_eos,
        },
    )
    items = read_batch_input(input_path)  # every line checked before a model loads
    if overwrite:
        output.unlink(missing_ok=True)
    params = SamplingParams(
        **{
            **cfg.sampling.model_dump(),
            "stop": tuple(cfg.sampling.stop),
            "stop_token_ids": tuple(cfg.sampling.stop_token_ids),
        }
    )
    storage, objects = storage_locations(storage_path, object_path)
    resolved = resolve_engine_model(cfg, model=model, storage_path=storage, object_path=objects)
    check_output(
        output, items, params, identity=resolved.identity
    )  # a foreign file stops us before a model loads
    built = build_engine(cfg, resolved)
    try:
        summary = run_batch(
            built,
            items,
            params,
            output=output,
            identity=resolved.identity,
            batch_size=max(64, 4 * cfg.max_batch_size),
            include_logprobs=logprobs,
            model_name=resolved.name,
        )
    finally:
        built.close()
    rate = summary.completion_tokens / summary.seconds if summary.seconds else 0.0
    typer.echo(
        f"wrote {summary.generated} samples to {output} ({summary.already_done} were already there,"
        f" {summary.total_samples} in all) in {summary.seconds:.1f}s, {rate:.1f} tokens/s"
    )
