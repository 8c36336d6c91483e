"""`rollout model ...`: make and inspect models.

    rollout model init-tiny ./models/tiny
    rollout model init-tiny ./models/tiny-llama --arch llama --seed 1 --force

torch/transformers are imported inside the commands so `rollout --help` stays instant.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

app = typer.Typer(help="Make and inspect models.", no_args_is_help=True)


@app.command("init-tiny")
def init_tiny(
    out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer to."),
    arch: str = typer.Option("qwen2", help="Architecture: qwen2 | llama."),
    seed: int = typer.Option(0, help="Seed for the weight init (the tokenizer is the same for every seed)."),
    hidden_size: int = typer.Option(128, help="Hidden size."),
    num_layers: int = typer.Option(4, help="Number of decoder layers."),
    num_heads: int = typer.Option(4, help="Attention heads (must divide hidden size)."),
    num_kv_heads: int = typer.Option(2, help="Key/value heads (must divide attention heads)."),
    intermediate_size: int = typer.Option(512, help="MLP intermediate size."),
    vocab_size: int = typer.Option(512, help="Vocabulary size (tokenizer and embedding rows)."),
    max_position_embeddings: int = typer.Option(512, help="Maximum sequence length."),
    tie_word_embeddings: bool = typer.Option(True, help="Share the input embedding with the LM head."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty OUT_DIR."),
) -> None:
    """Write a tiny random model + locally trained tokenizer (deterministic, offline)."""
    from rollout.models.tiny import count_saved_parameters, init_tiny_model

    started = time.perf_counter()
    path = init_tiny_model(
        out_dir,
        arch=arch,
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        force=force,
    )
    num_params = count_saved_parameters(path)
    elapsed = time.perf_counter() - started
    typer.echo(
        f"wrote tiny {arch} model: {num_params:,} parameters, vocab {vocab_size} -> {path} ({elapsed:.1f}s)"
    )
