"""`rollout dashboard`: a read-only web UI over the run store.

    rollout dashboard --storage-path local/rollout.db --object-path local/object-store   # http://127.0.0.1:8080/
    rollout dashboard --dsn postgresql://me@db/rollout --port 0     # any free port (printed)
    rollout dashboard --storage-path local/rollout.db --api-key "$KEY"   # open http://127.0.0.1:8080/#key=KEY

Runs (status, crashed marker, latest metrics), a run's live metric plots,
events, snapshots with the commands to export or resume them, evals, and
several runs on one plot (`rollout.dashboard.app`). Storage flags as in
`rollout snapshot` (see `rollout.cli.snapshot`); the store is never written,
and `--object-path` only goes into the export lines the page shows.
The key also comes from $ROLLOUT_DASHBOARD_KEY. Only light imports here
(fastapi and uvicorn load after the arguments are parsed).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from rollout.cli.runs import DEFAULT_HEARTBEAT_TIMEOUT_S
from rollout.cli.snapshot import (
    DEFAULT_STORAGE_PATH,
    ConfigOption,
    ObjectPathOption,
    StorageFlags,
    StoragePathOption,
    open_metadata_store,
)
from rollout.errors import RolloutError

LOOPBACK = ("127.0.0.1", "localhost", "::1")

DashboardDsnOption = Annotated[
    str | None,
    typer.Option(
        "--dsn", "--postgres-dsn", help="PostgreSQL DSN (postgresql://…); used instead of --storage-path."
    ),
]

HeartbeatTimeoutOption = Annotated[
    float,
    typer.Option(
        "--heartbeat-timeout",
        envvar="ROLLOUT_HEARTBEAT_TIMEOUT",
        min=0.1,
        metavar="SECONDS",
        help="Show running runs with no heartbeat for this long as crashed (the store is not changed).",
    ),
]


def dashboard(
    storage_path: StoragePathOption = None,
    dsn: DashboardDsnOption = None,
    config: ConfigOption = None,
    object_path: ObjectPathOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Interface to bind (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one.")
    ] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="ROLLOUT_DASHBOARD_KEY",
            help="Require `Authorization: Bearer KEY` on the API; the page takes it from /#key=KEY.",
        ),
    ] = None,
    heartbeat_timeout: HeartbeatTimeoutOption = DEFAULT_HEARTBEAT_TIMEOUT_S,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "warning",
) -> None:
    """Serve a read-only web dashboard of the runs in the store."""
    flags = StorageFlags(storage_path=storage_path, object_path=object_path, dsn=dsn, config=config)
    with open_metadata_store(flags) as store:  # a missing store fails here, before the port is taken
        listener = _bind(host, port)

        import uvicorn  # fastapi and uvicorn load only now: `rollout --help` stays fast

        from rollout.dashboard.app import LOOPBACK_HOSTS, DashboardSettings, create_app

        settings = DashboardSettings(
            api_key=api_key or None,
            heartbeat_timeout_s=heartbeat_timeout,
            storage_args=_storage_args(flags),
            # On loopback, answer only loopback Host headers (no DNS rebinding from a web page).
            allowed_hosts=LOOPBACK_HOSTS if host in LOOPBACK else None,
        )
        app = create_app(store, settings)
        bound_host, bound_port = listener.getsockname()[:2]
        if host not in LOOPBACK and not api_key:
            print(
                f"warning: dashboard on {host} without --api-key: anyone who can reach it can read the runs",
                file=sys.stderr,
            )
        url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        typer.echo(f"dashboard on http://{url_host}:{bound_port}/ (api key {'on' if api_key else 'off'})")
        sys.stdout.flush()
        server = uvicorn.Server(
            uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=3)
        )
        server.run(sockets=[listener])


def _storage_args(flags: StorageFlags) -> tuple[str, ...]:
    """How the copyable `rollout snapshot export` lines name this store, as absolute paths.

    Never a DSN (it may hold a password): `--dsn DSN` stands for it. The object store is the
    one `--object-path` (or $ROLLOUT_OBJECT_PATH) names; the dashboard itself never reads it.
    """
    if flags.dsn:
        args: tuple[str, ...] = ("--dsn", "DSN")
    elif flags.storage_path is None and flags.config is not None:
        args = ("--config", str(Path(flags.config).resolve()))
    else:
        path = flags.storage_path or Path(os.environ.get("ROLLOUT_STORAGE_PATH") or DEFAULT_STORAGE_PATH)
        args = ("--storage-path", str(Path(path).resolve()))
    objects = flags.object_path or os.environ.get("ROLLOUT_OBJECT_PATH")
    return (*args, "--object-path", str(Path(objects).resolve())) if objects else args


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RolloutError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.listen(128)  # a browser that connects once the URL is printed waits until uvicorn accepts
    sock.set_inheritable(True)
    return sock


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)

