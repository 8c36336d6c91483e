"""The s3 object store against a real S3 server (moto's server mode on 127.0.0.1, see conftest.py).

Transient failures are injected on the real request path: a botocore `before-send` hook answers the
first requests of an operation with a 503 (or blocks them) instead of sending them; everything else
reaches the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import boto3
import pytest
from botocore.awsrequest import AWSResponse

from rollout.backends.base import BackendState
from rollout.cli.main import main
from rollout.config import parse_config
from rollout.errors import BlobCorrupted, BlobNotFound, ConfigError, StorageError
from rollout.run import run_lifecycle, save_train_state
from rollout.snapshots import Blob, commit_snapshot, read_snapshot_blob
from rollout.store import open_object_store, open_store
from rollout.store.s3 import S3ObjectStore
from rollout.store.write_behind import WriteBehindObjectStore

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT = Path(sys.executable).parent / "rollout"
SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
DENIED = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: object):
        yield self._body


class FaultInjector:
    """A `before-send` hook on one S3 operation: answers the first `fail` requests with `status`/`body`
    (after waiting for `gate`, if given) and lets the rest through to the server."""

    def __init__(self, fail: int, *, status: int = 503, body: bytes = SLOW_DOWN, gate: threading.Event | None = None):
        self.fail, self.status, self.body, self.gate = fail, status, body, gate
        self.calls = 0
        self.failed = 0

    def __call__(self, request, **_: object) -> AWSResponse | None:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if self.failed < self.fail:
            self.failed += 1
            return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Raw(self.body))
        return None


def inject(objects: S3ObjectStore, operation: str, injector: Callable) -> Callable:
    objects.client.meta.events.register(f"before-send.s3.{operation}", injector)
    return injector


def s3_store(bucket, prefix: str = "objects", **kwargs) -> S3ObjectStore:
    store = open_object_store("s3", path=Path("unused"), url=bucket.url(prefix), endpoint_url=bucket.endpoint_url, **kwargs)
    assert isinstance(store, S3ObjectStore)
    return store


def raw_client(bucket):
    return boto3.client("s3", endpoint_url=bucket.endpoint_url)


def bucket_keys(bucket) -> list[str]:
    return sorted(o["Key"] for o in raw_client(bucket).list_objects_v2(Bucket=bucket.name).get("Contents", []))


def digest_of(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# --------------------------------------------------------------------------- the store itself


def test_put_get_verify_in_the_fs_layout(s3_bucket):
    objects = s3_store(s3_bucket)
    puts = inject(objects, "PutObject", FaultInjector(0))
    data = b"hello, rollout"
    digest = objects.put_bytes(data)
    assert digest == digest_of(data)
    assert bucket_keys(s3_bucket) == [f"objects/{digest[:2]}/{digest[2:4]}/{digest}"]
    assert objects.get_bytes(digest) == data
    assert objects.exists(digest) and not objects.exists("ab" * 32)
    assert objects.put_bytes(data) == digest  # already there: no second upload
    assert puts.calls == 1
    assert list(objects.iter_digests()) == [digest]
    objects.delete(digest)
    objects.delete(digest)  # deleting a missing blob is fine
    assert bucket_keys(s3_bucket) == []
    with pytest.raises(BlobNotFound, match=f"blob not found: {digest} \\(object store s3://{s3_bucket.name}/objects\\)"):
        objects.get_bytes(digest)


def test_multipart_upload_of_a_blob_over_8_mib_with_a_part_retried(s3_bucket, tmp_path):
    objects = s3_store(s3_bucket)
    parts = inject(objects, "UploadPart", FaultInjector(1))
    data = os.urandom(9 * (1 << 20) + 17)
    source = tmp_path / "weights.bin"
    source.write_bytes(data)
    digest = objects.put_file(source)
    assert digest == digest_of(data)
    assert (parts.failed, parts.calls) == (1, 3)  # two parts of 8 MiB chunks, the first failed once
    head = raw_client(s3_bucket).head_object(Bucket=s3_bucket.name, Key=objects.key_for(digest))
    assert head["ETag"].strip('"').endswith("-2") and head["ContentLength"] == len(data)
    dest = tmp_path / "out" / "weights.bin"
    objects.get_file(digest, dest)
    assert dest.read_bytes() == data
    assert objects.get_bytes(digest) == data
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["weights.bin"]  # no temp file left


def test_transient_failures_are_retried_with_backoff(s3_bucket):
    objects = s3_store(s3_bucket, max_attempts=4)
    puts = inject(objects, "PutObject", FaultInjector(2))
    gets = inject(objects, "GetObject", FaultInjector(1, status=500, body=b""))
    digest = objects.put_bytes(b"survives two 503s")
    assert (puts.failed, puts.calls) == (2, 3)
    assert raw_client(s3_bucket).get_object(Bucket=s3_bucket.name, Key=objects.key_for(digest))["Body"].read() == (
        b"survives two 503s"
    )
    assert objects.get_bytes(digest) == b"survives two 503s"
    assert (gets.failed, gets.calls) == (1, 2)


def test_failures_past_max_attempts_are_one_storage_error(s3_bucket):
    objects = s3_store(s3_bucket, max_attempts=2)
    puts = inject(objects, "PutObject", FaultInjector(10))
    with pytest.raises(StorageError, match=r"cannot upload blob [0-9a-f]{64} in s3://.*SlowDown") as info:
        objects.put_bytes(b"never lands")
    assert not isinstance(info.value, BlobNotFound)
    assert puts.calls == 2
    assert bucket_keys(s3_bucket) == []


def test_digest_mismatch_is_blob_corrupted_on_every_read(s3_bucket, tmp_path):
    objects = s3_store(s3_bucket)
    digest = objects.put_bytes(b"x" * 1000)
    raw_client(s3_bucket).put_object(Bucket=s3_bucket.name, Key=objects.key_for(digest), Body=b"x" * 999 + b"y")
    with pytest.raises(BlobCorrupted, match=f"blob {digest} is corrupted: its bytes hash to {digest_of(b'x' * 999 + b'y')}"):
        objects.get_bytes(digest)
    dest = tmp_path / "restored.bin"
    with pytest.raises(BlobCorrupted):
        objects.get_file(digest, dest)
    assert list(tmp_path.iterdir()) == []  # neither dest nor a temp file


@pytest.mark.parametrize("bad", ["../x", "AB" * 32, "ab" * 31, "g" * 64, "/" + "a" * 63])
def test_bad_digests_never_reach_the_bucket(s3_bucket, tmp_path, bad):
    objects = s3_store(s3_bucket)
    seen = []
    objects.client.meta.events.register("before-send.s3", lambda request, **_: seen.append(request.url))
    for call in (objects.get_bytes, objects.exists, objects.delete, lambda d: objects.get_file(d, tmp_path / "x")):
        with pytest.raises(StorageError, match="invalid blob digest"):
            call(bad)
    assert seen == []


def test_iter_digests_lists_only_blobs_under_the_prefix(s3_bucket):
    objects = s3_store(s3_bucket, prefix="team/run-store")
    digests = sorted(objects.put_bytes(bytes([i])) for i in range(3))
    client = raw_client(s3_bucket)
    d = digests[0]
    for stray in ("team/run-store/README", f"team/run-store/ff/ff/{d}", f"other/{d[:2]}/{d[2:4]}/{d}",
                  f"team/run-store-2/{d[:2]}/{d[2:4]}/{d}"):  # fmt: skip
        client.put_object(Bucket=s3_bucket.name, Key=stray, Body=b"?")
    assert list(objects.iter_digests()) == digests


def test_a_missing_bucket_or_missing_credentials_fail_at_open(s3_bucket, monkeypatch):
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        open_object_store("s3", path=Path("x"), url="s3://no-such-bucket-here/p", endpoint_url=s3_bucket.endpoint_url)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup on a dev box
    with pytest.raises(StorageError, match="no AWS credentials found"):
        s3_store(s3_bucket)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://Bad_Bucket/p", "bucket name 'Bad_Bucket' is invalid"),
        ("s3://bucket..dots/p", "bucket name 'bucket..dots' is invalid"),
        ("s3://192.168.1.1/p", "is invalid"),
        ("s3://good-bucket/a/../b", "prefix 'a/../b' is invalid"),
        ("s3://good-bucket/a//b", "prefix 'a//b' is invalid"),
        ("https://good-bucket/p", "must look like s3://bucket/prefix"),
        ("gs://good-bucket/p", "does not match backend 's3'"),
    ],
)
def test_bad_urls_are_refused_before_any_request(url, problem):
    with pytest.raises(StorageError, match=problem):
        open_object_store("s3", path=Path("x"), url=url)


# --------------------------------------------------------------------------- write-behind uploads


def snapshot_blobs(tag: str) -> dict[str, Blob]:
    return {"model": Blob(f"weights {tag}".encode()), "state": Blob(b'{"step": 1}')}


def test_write_behind_commits_the_row_only_after_every_blob_is_up(s3_bucket, tmp_path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    remote = s3_store(s3_bucket)
    gate = threading.Event()
    puts = inject(remote, "PutObject", FaultInjector(0, gate=gate))  # uploads hang until the gate opens
    objects = WriteBehindObjectStore(remote, tmp_path / "staging")

    started = time.perf_counter()
    record = commit_snapshot(store, objects, run_id=run.id, kind="train_state", step=1, blobs=snapshot_blobs("a"))
    assert time.perf_counter() - started < 5  # the caller did not wait for the (hung) upload
    assert store.list_snapshots() == []  # no row yet: its blobs are not in the bucket
    assert bucket_keys(s3_bucket) == []
    digests = sorted(entry["digest"] for entry in record.manifest["blobs"].values())
    assert read_snapshot_blob(objects, record, "model") == b"weights a"  # read back from the staged copy

    gate.set()
    objects.flush()
    assert [r.id for r in store.list_snapshots()] == [record.id]
    assert store.get_snapshot(record.id).manifest == record.manifest
    assert bucket_keys(s3_bucket) == sorted(f"objects/{d[:2]}/{d[2:4]}/{d}" for d in digests)
    assert list(objects.local.iter_digests()) == []  # staged copies go once uploaded
    assert puts.calls == 2
    objects.close()
    assert sorted(os.listdir(tmp_path / "staging")) == []
    store.close()


def test_closing_shows_how_far_the_pending_uploads_got(s3_bucket, tmp_path, monkeypatch, capsys):
    """A run's end waits for its staged blobs (`finish_uploads` -> `close`): from `ByteProgress.MIN_BYTES`
    pending (here lowered to 1 MiB) it says how many are up, every ~5%, as plain lines off a TTY."""
    from rollout.progress import ByteProgress

    monkeypatch.setattr(ByteProgress, "MIN_BYTES", 1 << 20)
    monkeypatch.setenv("ROLLOUT_LOG", "info")
    remote = s3_store(s3_bucket)
    inject(remote, "PutObject", lambda request, **_: time.sleep(0.3))  # a slow link: 0.3 s a blob
    objects = WriteBehindObjectStore(remote, tmp_path / "staging")
    digests = [objects.put_bytes(bytes([i]) * (256 << 10)) for i in range(8)]  # 2 MiB staged
    capsys.readouterr()
    objects.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith(f"upload={remote.location} mb=") for line in lines), lines
    assert lines[-1] == f"upload={remote.location} mb=2/2", lines
    assert bucket_keys(s3_bucket) == sorted(f"objects/{d[:2]}/{d[2:4]}/{d}" for d in digests)


def test_a_failed_upload_never_commits_its_row(s3_bucket, tmp_path):
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    remote = s3_store(s3_bucket)
    inject(remote, "PutObject", FaultInjector(100, status=403, body=DENIED))  # not transient: no retry
    objects = WriteBehindObjectStore(remote, tmp_path / "staging")
    # The first failed upload stops the queue; it surfaces at the next put (a later blob of this
    # snapshot, if the uploader thread got there first) or at the flush, whichever comes first.
    with pytest.raises(StorageError, match="AccessDenied"):
        commit_snapshot(store, objects, run_id=run.id, kind="train_state", step=1, blobs=snapshot_blobs("a"))
        objects.flush()
    with pytest.raises(StorageError, match="AccessDenied"):  # the queue stopped: later puts fail fast
        objects.put_bytes(b"more")
    objects.close()  # the failure was raised already
    assert store.list_snapshots() == []
    assert bucket_keys(s3_bucket) == []
    store.close()


CRASHING_WRITER = """
import sys, threading
from pathlib import Path
from rollout.store import open_object_store
from rollout.store.write_behind import WriteBehindObjectStore
endpoint, url, staging = sys.argv[1:]
remote = open_object_store("s3", path=Path(staging), url=url, endpoint_url=endpoint)
remote.client.meta.events.register("before-send.s3.PutObject", lambda **_: threading.Event().wait())
objects = WriteBehindObjectStore(remote, Path(staging))
print(objects.put_bytes(b"staged, never uploaded"), flush=True)
threading.Event().wait()
"""


def test_a_crash_mid_upload_is_discarded_by_the_next_start(s3_bucket, tmp_path, aws_env):
    staging = tmp_path / "staging"
    writer = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, s3_bucket.endpoint_url, s3_bucket.url(), str(staging)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, **aws_env},
    )  # fmt: skip
    try:
        digest = writer.stdout.readline().strip()
        assert digest == digest_of(b"staged, never uploaded")
        alive = WriteBehindObjectStore(s3_store(s3_bucket), staging)  # the writer is alive: its folder stays
        assert alive.discarded == 0
        assert [p.name for p in staging.rglob(digest)] == [digest]
        alive.close()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    restarted = WriteBehindObjectStore(s3_store(s3_bucket), staging)
    assert restarted.discarded == 1
    assert list(staging.rglob(digest)) == []
    assert not restarted.exists(digest) and bucket_keys(s3_bucket) == []
    restarted.close()
    assert os.listdir(staging) == []


# --------------------------------------------------------------------------- a run, and the CLI, on s3


def s3_run_config(tmp_path: Path, bucket, prefix: str = "objects") -> str:
    text = (ROOT / "examples" / "sft-tiny.toml").read_text()
    head, _, rest = text.partition("[storage.objects]")
    _, _, rest = rest.partition("\n[algorithm]")
    storage = (
        f'[storage.objects]\nbackend = "s3"\nurl = "{bucket.url(prefix)}"\n'
        f'endpoint_url = "{bucket.endpoint_url}"\npath = "{tmp_path / "staging"}"\n'
    )
    head = head.replace('path = "../local/rollout.db"', f'path = "{tmp_path / "rollout.db"}"')
    return head + storage + "\n[algorithm]" + rest


def test_a_run_on_s3_saves_without_waiting_and_resumes_from_the_bucket(s3_bucket, tmp_path):
    cfg = parse_config(s3_run_config(tmp_path, s3_bucket), source=tmp_path / "run.toml")
    state = BackendState(blobs={"model": b"\x01" * 64, "optimizer": b"\x02" * 64}, meta={"lr": 0.1})
    gate = threading.Event()
    with run_lifecycle(cfg, resume=None) as ctx:
        assert isinstance(ctx.objects, WriteBehindObjectStore)
        inject(ctx.objects.remote, "PutObject", FaultInjector(0, gate=gate))
        loop = {"step": 3, "cursor": {"epoch": 0, "batch": 3}, "tokens_seen": 12}
        record = save_train_state(ctx, state, step=3, loop_state=loop, static_blobs={}, extra={"algorithm": "sft"})
        assert ctx.store.list_snapshots() == []  # uploads still hang: no row, and training goes on
        gate.set()
    store = open_store("embedded", path=tmp_path / "rollout.db")
    assert store.get_run(ctx.run.id).status == "succeeded"
    assert [r.id for r in store.list_snapshots()] == [record.id]
    store.close()
    assert len(bucket_keys(s3_bucket)) == 3  # model, optimizer, state

    with run_lifecycle(cfg, resume=record.id) as resumed:
        restored, restored_loop = resumed.resume_state
        assert dict(restored.blobs) == dict(state.blobs) and restored_loop == loop


def test_a_run_whose_upload_fails_ends_failed_without_the_row(s3_bucket, tmp_path):
    cfg = parse_config(s3_run_config(tmp_path, s3_bucket), source=tmp_path / "run.toml")
    state = BackendState(blobs={"model": b"\x01" * 64}, meta={})
    with pytest.raises(StorageError, match="AccessDenied"), run_lifecycle(cfg, resume=None) as ctx:
        inject(ctx.objects.remote, "PutObject", FaultInjector(100, status=403, body=DENIED))
        save_train_state(ctx, state, step=1, loop_state={"step": 1}, static_blobs={}, extra={})
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.get_run(ctx.run.id)
    assert run.status == "failed" and "AccessDenied" in (run.error or "")
    assert store.list_snapshots() == []
    store.close()


def run_cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "AWS_"))}
    return subprocess.run([str(ROLLOUT), *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_snapshot_gc_and_a_corrupted_export_through_the_cli(s3_bucket, tmp_path, aws_env, monkeypatch, capsys):
    config = tmp_path / "run.toml"
    config.write_text(s3_run_config(tmp_path, s3_bucket))
    store = open_store("embedded", path=tmp_path / "rollout.db")
    run = store.create_run(algorithm="sft", config_digest="d", config_json="{}")
    objects = s3_store(s3_bucket)
    kept = commit_snapshot(store, objects, run_id=run.id, kind="train_state", step=2, blobs={
        "model_config": Blob(b'{"model_type": "llama"}'), "state": Blob(b'{"step": 2}')})  # fmt: skip
    dropped = commit_snapshot(store, objects, run_id=run.id, kind="buffer", step=1, blobs={"buf": Blob(b"old")})
    assert store.delete_snapshots([dropped.id]) == 1
    store.close()
    orphan = digest_of(b"old")
    assert orphan in set(objects.iter_digests())

    gc = run_cli("snapshot", "gc", "--config", str(config), cwd=tmp_path, env=aws_env)
    assert (gc.returncode, gc.stdout.strip()) == (0, "deleted 1 blobs"), gc.stderr
    assert set(objects.iter_digests()) == {e["digest"] for e in kept.manifest["blobs"].values()}

    config_digest = kept.manifest["blobs"]["model_config"]["digest"]
    raw_client(s3_bucket).put_object(Bucket=s3_bucket.name, Key=objects.key_for(config_digest), Body=b"{}")
    # in-process through the console script's entry point (a subprocess would import torch again: ~15 s)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["snapshot", "export", kept.id[:12], str(tmp_path / "out"), "--config", str(config)])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr
    assert stderr.startswith(f"error: blob {config_digest} is corrupted: its bytes hash to {digest_of(b'{}')}")
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


def test_the_s3_config_block_validates_and_bad_urls_are_located(tmp_path, s3_bucket):
    text = s3_run_config(tmp_path, s3_bucket, prefix="a/b")
    o = parse_config(text, source=tmp_path / "run.toml").storage.objects
    assert (o.backend, o.url, o.endpoint_url, o.max_attempts) == ("s3", s3_bucket.url("a/b"), s3_bucket.endpoint_url, 5)
    bad = text.replace(s3_bucket.url("a/b"), "s3://Bad_Bucket/a")
    with pytest.raises(ConfigError) as info:
        parse_config(bad, source=tmp_path / "run.toml")
    line = bad.splitlines().index('url = "s3://Bad_Bucket/a"') + 1
    assert str(info.value).startswith(f"{tmp_path / 'run.toml'}:{line}: storage.objects.url: bucket name 'Bad_Bucket'")
    no_url = text.replace(f'url = "{s3_bucket.url("a/b")}"\n', "")
    with pytest.raises(ConfigError, match='storage.objects: backend = "s3" needs url'):
        parse_config(no_url, source=tmp_path / "run.toml")
