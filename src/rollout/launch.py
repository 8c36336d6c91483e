"""Launching `rollout train` as torchrun ranks, and ending a run its ranks left behind.

    rollout train sft --config run.toml      # [distributed] kind = "torchrun", nproc_per_node = 2
    # runs: python -m torch.distributed.run --standalone --nproc-per-node 2 \
    #           -m rollout.cli.main train sft --config /abs/run.toml

`rollout train` calls `launch_torchrun` when the config says torchrun and no launcher started it
(`rollout.distributed.under_launcher`). The ranks then do the work (`rollout.distributed`); this
process waits for torchrun, forwards its exit status, and marks the run `failed` when the job
failed and rank 0 could not say so itself (rank 0 tells it the run id through
`$ROLLOUT_RUN_ID_FILE`). No torch import here: torchrun is a separate process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from rollout.config import RunConfig, TorchrunDistributedConfig
from rollout.distributed import RUN_ID_FILE_ENV
from rollout.run import open_stores


def torchrun_command(dist: TorchrunDistributedConfig, args: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run ... -m rollout.cli.main <args>`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dist.nproc_per_node)]
    if dist.nnodes > 1:
        assert dist.rdzv_endpoint is not None  # the config requires it
        cmd += ["--nnodes", str(dist.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", dist.rdzv_endpoint]
    else:
        cmd += ["--standalone"]  # a free local port: several jobs on one host don't collide
    return [*cmd, "-m", "rollout.cli.main", *args]


def launch_torchrun(
    cfg: RunConfig, args: Sequence[str], *, resume: str | None = None, env: Mapping[str, str] | None = None
) -> int:
    """Run `rollout <args>` under torch.distributed.run (`env` added to this process's environment);
    returns its exit status.

    `resume` (the snapshot id in `args`) is looked up first, so a bad id fails before any process
    starts. When the job fails and rank 0 could not end the run itself (it was the rank killed, or
    torchrun stopped it first), the run is marked `failed` here, so it never stays `running`.
    """
    assert isinstance(cfg.distributed, TorchrunDistributedConfig)
    if resume is not None:
        store, _ = open_stores(cfg)
        try:
            store.get_snapshot(resume)  # SnapshotNotFound: one clear line, exit 2
        finally:
            store.close()
    with tempfile.TemporaryDirectory(prefix="rollout-torchrun-") as tmp:
        id_file = Path(tmp) / "run-id"
        proc = subprocess.Popen(torchrun_command(cfg.distributed, args),
                                env={**os.environ, **(env or {}), RUN_ID_FILE_ENV: str(id_file)})
        try:
            status = proc.wait()
        except KeyboardInterrupt:  # torchrun got the same SIGINT (one process group): let it stop its ranks
            status = proc.wait()
            end_orphaned_run(cfg, id_file, "cancelled", "interrupted")
            raise
        if status != 0:
            how = f"signal {-status}" if status < 0 else f"exit status {status}"
            run_id = end_orphaned_run(
                cfg, id_file, "failed", f"a torchrun rank failed (torchrun {how}; the ranks' output names it)"
            )
            which = f"; run {run_id} is marked failed" if run_id else ""
            print(f"error: torchrun job failed ({how}){which}", file=sys.stderr)
    return status if status >= 0 else 128 - status


def end_orphaned_run(cfg: RunConfig, id_file: Path, status: Literal["failed", "cancelled"], error: str) -> str | None:
    """Give the run rank 0 announced `status` if it is still pending or running; its id (None: no run)."""
    try:
        run_id = id_file.read_text().strip()
    except FileNotFoundError:
        return None  # rank 0 never created a run (a bad config, or another host holds rank 0)
    store, _ = open_stores(cfg)
    try:
        if store.get_run(run_id).status in ("pending", "running"):
            store.set_run_status(run_id, status, error=error)
    finally:
        store.close()
    return run_id
