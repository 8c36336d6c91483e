"""Helpers for the inference tests (a unique module name: several test folders have a conftest.py)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A real uvicorn server on a loopback port, in a thread of this process."""

    base_url: str
    root: str
    server: object
    thread: threading.Thread
    app: object

    def stop(self) -> None:
        self.server.should_exit = True  # type: ignore[attr-defined]
        self.thread.join(timeout=20)


def start_server(engine, **settings) -> LiveServer:
    """Serve `engine` with `ServerSettings(**settings)`; returns once the port accepts connections."""
    import uvicorn

    from rollout.serve.app import ServerSettings, create_app

    app = create_app(engine, ServerSettings(**settings))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    root = f"http://127.0.0.1:{port}"
    return LiveServer(f"{root}/v1", root, server, thread, app)
