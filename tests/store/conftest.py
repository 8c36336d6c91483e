"""Real servers for the bucket-store tests, one per test session (and xdist worker), an empty bucket
per test: S3 is moto's server mode on 127.0.0.1; GCS is gcp-storage-emulator (its JSON API) on 127.0.0.1."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",  # the developer's own AWS files never leak in
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}


@dataclass(frozen=True)
class S3Bucket:
    endpoint_url: str
    name: str

    def url(self, prefix: str = "objects") -> str:
        return f"s3://{self.name}/{prefix}"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """http://127.0.0.1:<free port> of a moto S3 server running in this process."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Fake credentials through the usual AWS environment variables."""
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    for key, value in TEST_ENV.items():
        monkeypatch.setenv(key, value)
    return dict(TEST_ENV)


@pytest.fixture
def s3_bucket(s3_endpoint: str, aws_env: dict[str, str]) -> S3Bucket:
    """A new empty bucket on the test server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return S3Bucket(s3_endpoint, name)


# --------------------------------------------------------------------------- GCS


@dataclass(frozen=True)
class GcsBucket:
    endpoint_url: str
    name: str

    def url(self, prefix: str = "objects") -> str:
        return f"gs://{self.name}/{prefix}"


class GcsTraffic:
    """What reached the emulator (method, path), and faults it answers instead of handling: the first
    `count` requests that `match` get a bare `status` (the real server path, made faulty on purpose)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.faults: list[list] = []  # [match, count, status]
        self.failed = 0

    def fail(self, match: Callable[[str, str], bool], count: int, status: int = 503) -> None:
        self.faults.append([match, count, status])

    def uploads(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[1].startswith("/upload/")]


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[tuple[str, type]]:
    """(http://127.0.0.1:<free port>, the emulator's request handler class), in memory, in this process."""
    from gcp_storage_emulator.server import RequestHandler, create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # it logs every 404 as an error
    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    host, port = server._api._httpd.server_address[:2]
    yield f"http://{host}:{port}", RequestHandler
    server.stop()


@pytest.fixture
def gcs_traffic(gcs_server, monkeypatch: pytest.MonkeyPatch) -> GcsTraffic:
    traffic = GcsTraffic()
    handler_class = gcs_server[1]
    for method in ("GET", "POST", "PUT", "DELETE"):
        real = getattr(handler_class, f"do_{method}")

        def handle(handler, real=real, method=method) -> None:
            traffic.requests.append((method, handler.path))
            for fault in traffic.faults:
                match, count, status = fault
                if count > 0 and match(method, handler.path):
                    fault[1] -= 1
                    traffic.failed += 1
                    handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
                    handler.send_response(status)
                    handler.send_header("Content-Length", "0")
                    handler.end_headers()
                    return
            real(handler)

        monkeypatch.setattr(handler_class, f"do_{method}", handle)
    return traffic


@pytest.fixture
def gcs_bucket(gcs_server, gcs_traffic: GcsTraffic, monkeypatch: pytest.MonkeyPatch) -> GcsBucket:
    """A new empty bucket on the emulator; no Google credentials (gcsfs goes anonymous)."""
    from gcsfs.core import GCSFileSystem

    for key in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # no metadata-server probe for credentials on a dev box
    endpoint = gcs_server[0]
    name = f"test-{uuid.uuid4().hex[:16]}"
    GCSFileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(name)
    gcs_traffic.requests.clear()
    return GcsBucket(endpoint, name)
