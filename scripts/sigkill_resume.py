"""SIGKILL an SFT run on PostgreSQL + S3 again and again; after every kill the store must be consistent,
and resuming from the last snapshot must end byte-identical to an uninterrupted run (issue 16).

    .venv/bin/python scripts/sigkill_resume.py                              # 20 kills, seed 0 (~8 min on 2 busy CPUs)
    .venv/bin/python scripts/sigkill_resume.py --kills 3 --steps 60 --seed 1
    .venv/bin/python scripts/sigkill_resume.py --postgres-dsn postgresql://postgres@127.0.0.1:5432/test

What it does, all on 127.0.0.1:
  * a moto S3 server in this process, behind a WSGI layer that throttles uploads (so kills land inside
    them) and, like S3, stores nothing from a request whose body never fully arrived;
  * a fresh PostgreSQL schema (created here, dropped at the end) as the metadata store;
  * a tiny model and arithmetic data (`rollout model init-tiny`, `rollout data arithmetic`);
  1. an uninterrupted reference run (`rollout train sft`), snapshots every few steps;
  2. the same training config, under another bucket prefix, started as a subprocess and SIGKILLed at a
     seeded random point -- during startup, mid-step, mid-upload of a snapshot, or at the very end
     (final snapshot, export) -- then checked: every snapshot row's blobs are in the bucket and hash to
     their digest, and no run is left `pending`/`running` once its heartbeat is stale; then resumed
     (`--resume <id of the newest snapshot row>`) and killed again, `--kills` times, then let finish;
  3. the final exported weights and the final train_state blobs are compared with the reference.

Prints a table of the kills and a one-line verdict; exit 0 only if every check holds (2 on bad setup).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROLLOUT = Path(sys.executable).parent / "rollout"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",  # the developer's own AWS files never leak in
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}
HEARTBEAT_S = 0.25  # the trainers' $ROLLOUT_HEARTBEAT_S: a killed run goes stale quickly
STALE_S = 1.0  # readers' heartbeat timeout when they look for crashed runs
KILL_KINDS = ("startup", "step", "upload")
KIND_WEIGHTS = (0.2, 0.4, 0.4)
# A killed run is `crashed` (marked by a reader once its heartbeat is stale), or `succeeded` when the
# kill came after its last word (interpreter teardown); never left `pending` / `running`, never `failed`.
KILLED_RUN_STATUSES = ("crashed", "succeeded")


class SetupError(Exception):
    """Something this script needs is missing (PostgreSQL unreachable, a tool failing): exit 2."""


# --------------------------------------------------------------------------- the S3 server


class ThrottledS3:
    """A WSGI layer over moto's S3 app: counts writes (PUT/POST) and reads each write's body at
    `bytes_per_s` before moto sees it. A body cut short (its client was killed) is answered 400 and
    never reaches moto -- S3 stores nothing of an incomplete request either."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.bytes_per_s: float | None = None
        self.lock = threading.Lock()
        self.writes_started = 0
        self.writes_done = 0
        self.aborted = 0  # bodies that never fully arrived

    @property
    def in_flight(self) -> int:
        with self.lock:
            return self.writes_started - self.writes_done

    def __call__(self, environ: dict, start_response: Callable) -> object:
        if environ["REQUEST_METHOD"] not in ("PUT", "POST"):
            return self.app(environ, start_response)
        with self.lock:
            self.writes_started += 1
        try:
            body = self._read_body(environ)
            if body is None:
                with self.lock:
                    self.aborted += 1
                start_response("400 Bad Request", [("Content-Type", "application/xml"), ("Content-Length", "0")])
                return [b""]
            environ["wsgi.input"] = io.BytesIO(body)
            return self.app(environ, start_response)
        finally:
            with self.lock:
                self.writes_done += 1

    def _read_body(self, environ: dict) -> bytes | None:
        stream, length = environ["wsgi.input"], environ.get("CONTENT_LENGTH") or ""
        remaining = int(length) if length.isdigit() else None  # None: chunked, werkzeug dechunks to EOF
        parts: list[bytes] = []
        try:
            while remaining is None or remaining > 0:
                chunk = stream.read(65536 if remaining is None else min(65536, remaining))
                if not chunk:
                    break
                parts.append(chunk)
                if remaining is not None:
                    remaining -= len(chunk)
                if self.bytes_per_s:
                    time.sleep(len(chunk) / self.bytes_per_s)
        except (OSError, ValueError):
            return None
        return None if remaining else b"".join(parts)


@contextmanager
def s3_server() -> Iterator[tuple[str, ThrottledS3]]:
    """(http://127.0.0.1:<free port>, its throttle) of a moto S3 server on a thread of this process."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    throttle = ThrottledS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, throttle, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", throttle
    finally:
        server.shutdown()
        thread.join()


# --------------------------------------------------------------------------- PostgreSQL


@contextmanager
def postgres_schema(base_dsn: str) -> Iterator[str]:
    """A DSN whose search_path is a fresh schema in `base_dsn`'s database, dropped afterwards."""
    try:
        import psycopg
    except ImportError as err:
        raise SetupError("psycopg is not installed (pip install 'rollout[postgres]')") from err
    try:
        admin = psycopg.connect(base_dsn, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as err:
        first = (str(err).strip().splitlines() or ["?"])[0]
        raise SetupError(f"PostgreSQL not reachable at {base_dsn}: {first}") from err
    schema = f"rollout_sigkill_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{base_dsn}{'&' if '?' in base_dsn else '?'}options=-csearch_path%3D{schema}"
    finally:
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        admin.close()


# --------------------------------------------------------------------------- workspace and trainers


@dataclass(frozen=True)
class Workspace:
    root: Path
    endpoint: str
    bucket: str
    dsn: str
    steps: int
    every: int

    def config(self, name: str) -> Path:
        return self.root / f"{name}.toml"

    def prefix(self, name: str) -> str:
        return f"{name}/objects"

    def export_dir(self, name: str) -> Path:
        return self.root / f"export-{name}"

    def staging(self, name: str) -> Path:
        return self.root / f"staging-{name}"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"


def sft_config(ws: Workspace, name: str) -> str:
    """The run config: only the bucket prefix, staging folder and export folder differ per `name`."""
    return f"""schema_version = 1
seed = 0
[storage]
backend = "postgres"
runs_dir = "{ws.runs_dir}"
[storage.postgres]
dsn = "{ws.dsn}"
[storage.objects]
backend = "s3"
url = "s3://{ws.bucket}/{ws.prefix(name)}"
endpoint_url = "{ws.endpoint}"
path = "{ws.staging(name)}"
[backend]
device = "cpu"
num_threads = 1
[algorithm]
kind = "sft"
[algorithm.sft]
minibatch_size = 8
gradient_accumulation = 1
[algorithm.sft.base_model]
uri = "{ws.root / "models" / "tiny"}"
dtype = "float32"
[algorithm.sft.optimizer]
kind = "adamw"
lr = 3e-3
[algorithm.sft.scheduler]
kind = "cosine"
warmup_steps = 10
min_lr_ratio = 0.1
[algorithm.sft.budget]
max_steps = {ws.steps}
[algorithm.sft.dataset]
kind = "jsonl_path"
path = "{ws.root / "data" / "sft.jsonl"}"
[algorithm.sft.packing]
kind = "off"
max_seq_len = 64
[algorithm.sft.loss_on]
kind = "assistant"
[algorithm.sft.snapshot]
every_steps = {ws.every}
keep_last = 3
[algorithm.sft.export]
dir = "{ws.export_dir(name)}"
[distributed]
kind = "local"
"""


def trainer_env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "AWS_"))}
    return {**clean, **AWS_ENV, "ROLLOUT_HEARTBEAT_S": str(HEARTBEAT_S), "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def make_workspace(root: Path, *, endpoint: str, dsn: str, steps: int, every: int) -> Workspace:
    import boto3

    bucket = f"sigkill-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)  # AWS_ENV is set (run_experiment)
    ws = Workspace(root, endpoint, bucket, dsn, steps, every)
    for args in (["model", "init-tiny", str(root / "models" / "tiny")], ["data", "arithmetic", str(root / "data")]):
        done = subprocess.run([str(ROLLOUT), *args], env=trainer_env(), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SetupError(f"rollout {' '.join(args)} failed: {done.stderr.strip()[-400:]}")
    for name in ("reference", "chaos"):
        ws.config(name).write_text(sft_config(ws, name))
    return ws


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if this script dies (Linux prctl PR_SET_PDEATHSIG), so a
    killed script or test leaves no trainer behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class Trainer:
    """One `rollout train sft` process; follows its run's events.jsonl for the step it reached."""

    def __init__(self, ws: Workspace, name: str, *, resume: str | None, tag: str) -> None:
        self.ws = ws
        self.run_id_file = ws.root / f"run-id-{tag}"
        self.log = ws.root / f"train-{tag}.log"
        args = [str(ROLLOUT), "train", "sft", "--config", str(ws.config(name))]
        args += ["--resume", resume] if resume else []
        env = {**trainer_env(), "ROLLOUT_RUN_ID_FILE": str(self.run_id_file)}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ws.root,
                                         preexec_fn=_die_with_parent)  # fmt: skip
        self.spawned = time.time()
        self.step = 0
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self._offset = 0

    @property
    def run_id(self) -> str | None:
        text = self.run_id_file.read_text().strip() if self.run_id_file.exists() else ""
        return text or None

    def poll_step(self) -> int:
        """The last step its events.jsonl records (the recorder writes about 5 times a second)."""
        run_id = self.run_id
        path = self.ws.runs_dir / run_id / "events.jsonl" if run_id else None
        if path is None or not path.exists():
            return self.step
        with open(path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            if record.get("type") == "event" and record["name"] == "train_step":
                self.step = record["fields"]["step"]
                self.first_step_at = self.first_step_at or record["time"]
                self.last_step_at = record["time"]
        return self.step

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 300.0) -> bool:
        """Poll until `condition()`; False if the process ended first or the time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll_step()
            if condition():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.01)
        return False

    def finish(self, timeout_s: float = 600.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.poll_step()
        return rc

    def tail(self, chars: int = 800) -> str:
        return self.log.read_text(errors="replace")[-chars:]


# --------------------------------------------------------------------------- checks


@dataclass
class StoreCheck:
    rows: int = 0
    blobs_checked: int = 0
    problems: list[str] = field(default_factory=list)


class StoreChecker:
    """Reads the metadata store and the bucket the way a user would, after each kill."""

    def __init__(self, ws: Workspace) -> None:
        from rollout.store import open_store
        from rollout.store.s3 import S3ObjectStore

        self.store = open_store("postgres", dsn=ws.dsn)
        self.buckets = {
            name: S3ObjectStore(ws.bucket, ws.prefix(name), endpoint_url=ws.endpoint) for name in ("reference", "chaos")
        }
        self.verified: dict[str, str] = {}  # digest -> ETag of the object whose bytes were hashed

    def close(self) -> None:
        self.store.close()

    def check(self, *, bucket: str, run_ids: set[str]) -> StoreCheck:
        """Every snapshot row of `run_ids` names blobs that are in `bucket` with their size and digest
        (a blob is downloaded and hashed once; later checks compare its ETag); no run is still
        `pending` or `running` once readers have marked stale heartbeats as crashed."""
        from botocore.exceptions import ClientError

        from rollout.errors import RolloutError

        objects = self.buckets[bucket]
        result = StoreCheck()
        for record in self.store.list_snapshots():
            if record.run_id not in run_ids:
                continue
            result.rows += 1
            for name, entry in sorted(record.manifest["blobs"].items()):
                digest, where = entry["digest"], f"snapshot {record.id[:12]} (step {record.step}) blob {name!r}"
                result.blobs_checked += 1
                try:
                    head = objects.client.head_object(Bucket=objects.bucket, Key=objects.key_for(digest))
                except ClientError as err:
                    result.problems.append(f"{where}: {digest[:12]} not in the bucket ({err})")
                    continue
                if head["ContentLength"] != entry["size"]:
                    result.problems.append(f"{where}: {head['ContentLength']} bytes in the bucket, {entry['size']} in the row")
                elif self.verified.get(digest) != head["ETag"]:
                    try:
                        objects.get_bytes(digest)  # hashes the bytes: BlobCorrupted on a mismatch
                    except RolloutError as err:
                        result.problems.append(f"{where}: {err}")
                        continue
                    self.verified[digest] = head["ETag"]
        self.store.mark_crashed(timeout_s=STALE_S)  # what `rollout runs list` does first
        for run in self.store.list_runs():
            if run.id in run_ids and run.status in ("pending", "running"):
                result.problems.append(f"run {run.id} is still {run.status} after its process was killed")
        return result

    def newest_snapshot(self, run_ids: set[str]) -> tuple[str, int] | None:
        """(id, step) of the train_state row to resume from: the highest step, the newest on a tie."""
        rows = [r for r in self.store.list_snapshots(kind="train_state") if r.run_id in run_ids]
        if not rows:
            return None
        best = max(rows, key=lambda r: (r.step, r.created_at))
        return best.id, best.step

    def all_run_ids(self) -> set[str]:
        return {run.id for run in self.store.list_runs()}


# --------------------------------------------------------------------------- the experiment


@dataclass(frozen=True)
class Timing:
    """From the reference run: spawn -> first step, seconds per step, last step -> exit."""

    startup_s: float
    step_s: float
    end_s: float


@dataclass(frozen=True)
class PlannedKill:
    kind: str  # startup | step | upload | end
    target_step: int  # step | upload: kill once the run reached this step (at least one past its resume)
    u: float  # in [0, 1): where in its window the kill lands


@dataclass
class Kill:
    index: int
    plan: PlannedKill
    resumed_from_step: int | None
    t_s: float = 0.0  # since the process started
    step: int = 0  # the last step its events recorded
    writes_in_flight: int = 0  # S3 PUT/POST requests open at the kill
    aborted_bodies: int = 0  # uploads cut short by this kill (nothing stored)
    run_status: str = "-"  # its run's status once readers marked stale runs (no row yet: "-")
    rows: int = 0
    blobs: int = 0
    next_resume_step: int | None = None
    problems: list[str] = field(default_factory=list)


def plan_kills(rng: random.Random, *, kills: int, steps: int) -> list[PlannedKill]:
    """`kills` kill points in order: targets spread evenly over the run, the last one at its end."""
    plan = []
    for i in range(kills):
        if i == kills - 1 and kills >= 3:
            plan.append(PlannedKill("end", steps, rng.random()))
            continue
        kind = rng.choices(KILL_KINDS, KIND_WEIGHTS)[0]
        target = max(1, round((i + 1) * (steps - 1) / kills)) + rng.randint(-2, 2)
        plan.append(PlannedKill(kind, min(max(target, 1), steps - 1), rng.random()))
    return plan


def kill_once(trainer: Trainer, planned: PlannedKill, *, start_step: int, timing: Timing, s3: ThrottledS3,
              steps: int) -> tuple[str | None, int]:
    """Wait for the planned point and SIGKILL; returns (a problem or None, writes in flight at the kill)."""
    target = min(max(planned.target_step, start_step + 1), steps)
    reached = True
    if planned.kind == "startup":
        time.sleep(max(0.0, trainer.spawned + planned.u * timing.startup_s - time.time()))
    elif planned.kind == "step":
        reached = trainer.wait_until(lambda: trainer.step >= target)
        time.sleep(planned.u * 2 * timing.step_s)
    elif planned.kind == "upload":
        reached = trainer.wait_until(lambda: trainer.step >= target)
        seen = s3.writes_started
        reached = reached and trainer.wait_until(lambda: s3.writes_started > seen or s3.in_flight > 0)
        time.sleep(planned.u * 0.05)
    else:  # end: from the final snapshot's first upload on (its rows, the export, the run's last status)
        reached = trainer.wait_until(lambda: trainer.step >= steps)
        seen = s3.writes_started
        reached = reached and trainer.wait_until(lambda: s3.writes_started > seen or s3.in_flight > 0)
        time.sleep(planned.u * 0.5 * timing.end_s)
    in_flight = s3.in_flight
    if trainer.proc.poll() is not None:
        return f"the process ended (rc {trainer.proc.returncode}) before the kill: {trainer.tail(300)!r}", in_flight
    trainer.proc.send_signal(signal.SIGKILL)
    trainer.proc.wait()
    return (None if reached else f"kill point not reached (step {trainer.step}, target {target})"), in_flight


def reference_timing(trainer: Trainer, ended_at: float, steps: int) -> Timing:
    if trainer.first_step_at is None or trainer.last_step_at is None:
        raise SetupError(f"the reference run recorded no steps: {trainer.tail()}")
    return Timing(
        startup_s=trainer.first_step_at - trainer.spawned,
        step_s=(trainer.last_step_at - trainer.first_step_at) / max(1, steps - 1),
        end_s=max(0.2, ended_at - trainer.last_step_at),
    )


@dataclass
class Outcome:
    kills: list[Kill]
    timing: Timing
    reference: dict[str, str]  # what -> blake3 digest
    resumed: dict[str, str]
    final_check: StoreCheck
    problems: list[str]
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.problems and all(not k.problems for k in self.kills) and self.reference == self.resumed


def final_digests(checker: StoreChecker, ws: Workspace, name: str, run_ids: set[str]) -> dict[str, str]:
    """blake3 of the exported weights and of the final train_state's blobs (the row at the last step)."""
    import blake3

    weights = ws.export_dir(name) / "model.safetensors"
    out = {"export/model.safetensors": blake3.blake3(weights.read_bytes()).hexdigest() if weights.exists() else "-"}
    newest = checker.newest_snapshot(run_ids)
    if newest is not None and newest[1] == ws.steps:
        record = checker.store.get_snapshot(newest[0])
        for blob in ("model", "optimizer", "state"):
            out[f"train_state/{blob}"] = record.manifest["blobs"][blob]["digest"]
    return out


def run_experiment(*, kills: int, seed: int, base_dsn: str, steps: int, every: int,
                   bytes_per_s: float = 64e6, workdir: Path | None = None, log: Callable[[str], None] = print) -> Outcome:
    """The whole experiment; `workdir` (a temp folder by default) is removed unless a check fails."""
    started = time.monotonic()
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="sigkill-", dir=workdir))
    try:
        with aws_environment(), s3_server() as (endpoint, s3), postgres_schema(base_dsn) as dsn:
            ws = make_workspace(root, endpoint=endpoint, dsn=dsn, steps=steps, every=every)
            checker = StoreChecker(ws)
            try:
                log(f"workspace {root}; S3 {endpoint} bucket {ws.bucket}; schema {dsn.rsplit('%3D', 1)[-1]}")
                outcome = _chaos(ws, checker, s3, rng, kills=kills, bytes_per_s=bytes_per_s, log=log)
            finally:
                checker.close()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    outcome.wall_s = time.monotonic() - started
    if outcome.ok:
        shutil.rmtree(root, ignore_errors=True)
    else:
        log(f"kept the workspace for a look: {root}")
    return outcome


@contextmanager
def aws_environment() -> Iterator[None]:
    """This process's boto3 clients (the checker's) get the test credentials; restored afterwards."""
    saved = {key: os.environ.get(key) for key in AWS_ENV}
    os.environ.update(AWS_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _chaos(ws: Workspace, checker: StoreChecker, s3: ThrottledS3, rng: random.Random, *, kills: int,
           bytes_per_s: float, log: Callable[[str], None]) -> Outcome:
    started: list[Trainer] = []

    def start(name: str, *, resume: str | None, tag: str) -> Trainer:
        started.append(Trainer(ws, name, resume=resume, tag=tag))
        return started[-1]

    try:
        return _chaos_steps(ws, checker, s3, rng, kills=kills, bytes_per_s=bytes_per_s, log=log, start=start)
    finally:
        for trainer in started:  # an error or ^C here must not leave a trainer behind
            if trainer.proc.poll() is None:
                trainer.proc.kill()
                trainer.proc.wait()


def _chaos_steps(ws: Workspace, checker: StoreChecker, s3: ThrottledS3, rng: random.Random, *, kills: int,
                 bytes_per_s: float, log: Callable[[str], None], start: Callable[..., Trainer]) -> Outcome:
    problems: list[str] = []
    # 1. the uninterrupted reference
    reference = start("reference", resume=None, tag="reference")
    rc = reference.finish()
    ended_at = time.time()
    if rc != 0 or reference.run_id is None:
        raise SetupError(f"the reference run failed (rc {rc}): {reference.tail()}")
    timing = reference_timing(reference, ended_at, ws.steps)
    ref_ids = {reference.run_id}
    log(f"reference run {reference.run_id}: {ws.steps} steps, startup {timing.startup_s:.1f} s, "
        f"{timing.step_s * 1000:.0f} ms/step, end {timing.end_s:.1f} s")  # fmt: skip

    # 2. the same config, killed `kills` times
    s3.bytes_per_s = bytes_per_s
    plan = plan_kills(rng, kills=kills, steps=ws.steps)
    resume: tuple[str, int] | None = None
    done: list[Kill] = []
    log(HEADER)
    for index, planned in enumerate(plan, 1):
        kill = Kill(index, planned, resumed_from_step=resume[1] if resume else None)
        trainer = start("chaos", resume=resume[0] if resume else None, tag=f"chaos-{index:02d}")
        aborted_before = s3.aborted
        problem, kill.writes_in_flight = kill_once(
            trainer, planned, start_step=resume[1] if resume else 0, timing=timing, s3=s3, steps=ws.steps
        )
        killed_at = time.time()
        kill.t_s, kill.step = killed_at - trainer.spawned, trainer.poll_step()
        kill.problems += [problem] if problem else []
        time.sleep(max(0.0, killed_at + STALE_S + 0.05 - time.time()))  # its heartbeat is stale now
        chaos_ids = checker.all_run_ids() - ref_ids
        check = checker.check(bucket="chaos", run_ids=chaos_ids)
        kill.aborted_bodies = s3.aborted - aborted_before
        kill.rows, kill.blobs, kill.problems = check.rows, check.blobs_checked, kill.problems + check.problems
        if trainer.run_id is not None:
            kill.run_status = checker.store.get_run(trainer.run_id).status
            if kill.run_status not in KILLED_RUN_STATUSES:
                kill.problems.append(f"run {trainer.run_id} is {kill.run_status} after the kill")
        resume = checker.newest_snapshot(chaos_ids)
        kill.next_resume_step = resume[1] if resume else None
        done.append(kill)
        log(format_kill(kill))

    # 3. let it finish, then compare
    last = start("chaos", resume=resume[0] if resume else None, tag="chaos-final")
    rc = last.finish()
    if rc != 0:
        problems.append(f"the final resume failed (rc {rc}): {last.tail()}")
    chaos_ids = checker.all_run_ids() - ref_ids
    final_check = checker.check(bucket="chaos", run_ids=chaos_ids)
    problems += final_check.problems
    problems += checker.check(bucket="reference", run_ids=ref_ids).problems
    for run in checker.store.list_runs():
        expected = ("succeeded",) if run.id in (last.run_id, reference.run_id) else KILLED_RUN_STATUSES
        if run.status not in expected:
            problems.append(f"run {run.id} ended {run.status}, expected {' or '.join(expected)}")
    leftovers = [p for p in ws.staging("chaos").rglob("*") if p.is_file()]
    if leftovers:
        problems.append(f"{len(leftovers)} files left in the staging folder {ws.staging('chaos')}")
    ref_digests = final_digests(checker, ws, "reference", ref_ids)
    resumed_digests = final_digests(checker, ws, "chaos", chaos_ids)
    return Outcome(done, timing, ref_digests, resumed_digests, final_check, problems, wall_s=0.0)


# --------------------------------------------------------------------------- report


HEADER = (f"{'#':>2} {'kill point':<12} {'target':>6} {'from':>5} {'t(s)':>6} {'step':>5} {'PUTs':>4} "
          f"{'cut':>3} {'run':<9} {'rows':>4} {'blobs':>5} {'resume@':>7}  check")  # fmt: skip


def format_kill(k: Kill) -> str:
    target = "-" if k.plan.kind in ("startup", "end") else str(k.plan.target_step)
    origin = "0" if k.resumed_from_step is None else str(k.resumed_from_step)
    nxt = "start" if k.next_resume_step is None else str(k.next_resume_step)
    check = "ok" if not k.problems else "FAIL: " + "; ".join(k.problems)
    return (f"{k.index:>2} {k.plan.kind:<12} {target:>6} {origin:>5} {k.t_s:>6.1f} {k.step:>5} {k.writes_in_flight:>4} "
            f"{k.aborted_bodies:>3} {k.run_status:<9} {k.rows:>4} {k.blobs:>5} {nxt:>7}  {check}")  # fmt: skip


def report(outcome: Outcome, log: Callable[[str], None] = print) -> None:
    log("")
    log("kills (target: the step it waited for; from: the step it resumed from; t: seconds after spawn;")
    log("       step: last step its events recorded; PUTs: S3 writes open at the kill; cut: upload bodies cut short;")
    log("       run: its run's status after the kill; rows / blobs: snapshot rows of the killed chain and the")
    log("       blobs verified for them; resume@: the step of the newest row, where the next process starts)")
    log(HEADER)
    for kill in outcome.kills:
        log(format_kill(kill))
    log("")
    for what in sorted(set(outcome.reference) | set(outcome.resumed)):
        ref, res = outcome.reference.get(what, "-"), outcome.resumed.get(what, "-")
        log(f"{what:<26} reference {ref}  resumed {res}  {'equal' if ref == res else 'DIFFERENT'}")
    for problem in outcome.problems:
        log(f"problem: {problem}")
    kinds = {kind: sum(k.plan.kind == kind for k in outcome.kills) for kind in (*KILL_KINDS, "end")}
    failed = sum(bool(k.problems) for k in outcome.kills)
    mid_upload = sum(k.writes_in_flight > 0 for k in outcome.kills)
    verdict = "PASS" if outcome.ok else "FAIL"
    log(f"{verdict}: {len(outcome.kills)} SIGKILLs ({', '.join(f'{n} {k}' for k, n in kinds.items())}; "
        f"{mid_upload} with an S3 write open), store checks failed after {failed}; final "
        f"{outcome.final_check.rows} rows / {outcome.final_check.blobs_checked} blobs consistent; final weights "
        f"{'byte-identical' if outcome.reference == outcome.resumed else 'DIFFER'} to the uninterrupted run; "
        f"{outcome.wall_s:.0f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs before the run may finish (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--postgres-dsn", default=os.environ.get("ROLLOUT_TEST_PG_DSN", DEFAULT_DSN),
                        help=f"a database to make a scratch schema in (default {DEFAULT_DSN})")  # fmt: skip
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of the run (default 160)")
    parser.add_argument("--every", type=int, default=4, help="snapshot every this many steps (default 4)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the temp workspace goes")
    args = parser.parse_args(argv)
    if args.kills < 1 or args.every < 1 or args.steps < 2 * args.kills:
        parser.error("need --kills >= 1, --every >= 1 and --steps >= 2 * --kills")
    try:
        outcome = run_experiment(kills=args.kills, seed=args.seed, base_dsn=args.postgres_dsn, steps=args.steps,
                                 every=args.every, workdir=args.workdir)  # fmt: skip
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report(outcome)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
