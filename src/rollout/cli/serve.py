"""`rollout serve`: an OpenAI-compatible HTTP server for a model folder or a snapshot.

    rollout serve --model local/models/sft-tiny                          # http://127.0.0.1:8000/v1
    rollout serve --model local/models/rm-tiny --port 8001               # a reward model: POST /v1/rewards
    rollout serve --model 3f2a9c1e --port 8001 --api-key "$KEY" --admin-key "$ADMIN"
    rollout serve --model local/models/sft-tiny --port 0                 # any free port (printed)

Keys also come from $ROLLOUT_API_KEY / $ROLLOUT_ADMIN_KEY. Without an admin key
`POST /update_weights_from_disk` is refused. Limits come from the config's
`[inference.server]` block. Only light imports here (fastapi, torch and
uvicorn load after the arguments are parsed).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout.cli.infer import ConfigOption, DtypeOption, ModelOption, ThreadsOption, storage_locations
from rollout.cli.snapshot import ObjectPathOption, StoragePathOption
from rollout.errors import ConfigError, RolloutError

if TYPE_CHECKING:
    from rollout.inference.config import InferenceConfig
    from rollout.inference.models import ResolvedModel

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    model: ModelOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Interface to bind (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one.")
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="ROLLOUT_API_KEY", help="Require `Authorization: Bearer KEY`."),
    ] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(
            "--admin-key", envvar="ROLLOUT_ADMIN_KEY", help="Enables POST /update_weights_from_disk."
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="Name clients send as `model`.")
    ] = None,
    config: ConfigOption = None,
    max_batch_size: Annotated[
        int | None, typer.Option("--max-batch-size", min=1, help="Sequences per step.")
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option("--max-queue", min=1, help="Waiting requests before 503.")
    ] = None,
    dtype: DtypeOption = None,
    threads: ThreadsOption = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "warning",
    storage_path: StoragePathOption = None,
    object_path: ObjectPathOption = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    from rollout.algorithms.config import reward_model_dir_problem
    from rollout.inference.build import build_engine, resolve_engine_model
    from rollout.inference.config import load_inference_config, with_overrides

    cfg = with_overrides(
        load_inference_config(config),
        dtype=dtype,
        threads=threads,
        max_batch_size=max_batch_size,
        server={"max_queue": max_queue},
    )
    if cfg.engine == "openai":
        raise ConfigError('rollout serve runs the model itself: set inference.engine to "hf" or "vllm"')
    listener = _bind(host, port)  # fail on a taken port before loading the model

    # fastapi and uvicorn load only now: `rollout --help` stays fast
    from rollout.serve.app import ServerSettings, create_app

    storage, objects = storage_locations(storage_path, object_path)
    resolved = resolve_engine_model(cfg, model=model, storage_path=storage, object_path=objects)
    if reward_model_dir_problem(Path(resolved.path)) is None:  # an RM export: POST /v1/rewards, no generation
        _serve_reward_model(cfg, resolved, listener, host=host, api_key=api_key or None,
                            name=served_model_name or resolved.name, log_level=log_level)
        return
    engine = build_engine(cfg, resolved)
    s = cfg.server
    settings = ServerSettings(
        model_name=served_model_name or resolved.name,
        api_key=api_key or None,
        admin_key=admin_key or None,
        max_batch_size=cfg.max_batch_size,
        max_queue=s.max_queue,
        gather_window_s=s.gather_window_ms / 1000,
        max_body_bytes=s.max_body_bytes,
        max_tokens_limit=s.max_tokens_limit,
        max_n=s.max_n,
        max_prompts=s.max_prompts,
        retry_after_s=s.retry_after_s,
    )
    app = create_app(engine, settings)
    try:
        _run(app, listener, host=host, api_key=api_key, log_level=log_level, what=settings.model_name,
             details=f"api key {'on' if api_key else 'off'}, weight updates {'on' if admin_key else 'off'}")
    finally:
        engine.close()


def _serve_reward_model(
    cfg: InferenceConfig, resolved: ResolvedModel, listener: socket.socket, *, host: str, api_key: str | None, name: str,
    log_level: str,
) -> None:
    """Serve a reward model's scores (`rollout.serve.reward_app`): prompt + completion rendered as
    `rollout train rm` rendered its pairs, the first `max_model_len` tokens (default 512, the
    `max_seq_len` default of a reward entry) scored."""
    import torch

    from rollout.rl.reward_model import load_reward_model
    from rollout.serve.reward_app import RewardServerSettings, create_reward_app

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else "cpu" if cfg.device == "auto" else cfg.device
    rm = load_reward_model(resolved.path, device=torch.device(device), dtype=cfg.dtype, batch_size=cfg.max_batch_size,
                           max_seq_len=cfg.max_model_len or 512)
    app = create_reward_app(rm, RewardServerSettings(model_name=name, api_key=api_key,
                                                     max_body_bytes=cfg.server.max_body_bytes))
    _run(app, listener, host=host, api_key=api_key, log_level=log_level, what=f"reward model {name}",
         details=f"POST /v1/rewards; api key {'on' if api_key else 'off'}")


def _run(app: Any, listener: socket.socket, *, host: str, api_key: str | None, log_level: str, what: str,
         details: str) -> None:
    """Warn about an open port without a key, print where it serves, and run uvicorn on `listener`."""
    import uvicorn

    bound_host, bound_port = listener.getsockname()[:2]
    if host not in LOOPBACK and not api_key:
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    typer.echo(f"serving {what} on http://{_url_host(bound_host)}:{bound_port}/v1 ({details})")
    sys.stdout.flush()
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    )
    server.run(sockets=[listener])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RolloutError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    # listening from here on: a client that connects once "serving ..." is printed waits in the
    # backlog until uvicorn accepts it, instead of being refused while uvicorn starts
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
