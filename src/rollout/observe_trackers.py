"""Tracker sinks: TensorBoard, Weights & Biases and MLflow get every metric of a run, at the step
numbers the store has, and its resolved config (the run folder's `config.json`).

    [observe]
    tensorboard = true                                    # <run folder>/tensorboard/
    wandb = { project = "arith", mode = "offline" }       # <run folder>/wandb/offline-run-*-<run id>/
    mlflow = { tracking_uri = "http://127.0.0.1:5000" }   # default: the file store <runs folder>/mlruns

`open_tracker_sinks` turns `[observe]` into `RecordSink`s that `run_lifecycle` hands to the run's
`RunRecorder`, so they are written from its background thread, batch by batch, after the JSONL
file and the store. Events are not mirrored: the store and `events.jsonl` keep them.

- TensorBoard (`torch.utils.tensorboard`): one scalar per metric at its step; the config as the
  text `config` at step 0.
- W&B: a run whose id is the rollout run id, with the config as its config; one history row per
  step (`run.log(values, step=step)`). Offline runs upload later with `wandb sync <dir>`.
- MLflow: a run named after the rollout run id (tags `rollout.run_id`, `rollout.algorithm`); the
  flattened config as params (`algorithm.sft.optimizer.lr`, values cut at MLflow's limit) and
  whole as the artifact `rollout-config.json`; metrics with their steps. MLflow allows only
  `[/\\w.\\- :]` in names, so `@` becomes `_at_`, `^` `_hat_` and anything else `_`
  (`eval/pass@1` is `eval/pass_at_1` there). MLflow 3 keeps the file store (`file:` URIs,
  plain folders) behind `MLFLOW_ALLOW_FILE_STORE`, which is set for such a URI unless set already.

A tracker mirrors the run; it is not its record. Unlike the JSONL file and the store, whose
failure stops the run (`StorageError`), a tracker that cannot start or fails mid-run (disk full,
server gone) is reported once on stderr and dropped for the rest of the run (`GuardedSink`):
training goes on and the store still has every metric.

Each client is imported only when its sink opens; a config naming a tracker whose package is
missing is refused at validate time (`rollout.config.ObserveConfig`, `pip install 'rollout[trackers]'`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.observe import RecordSink
from rollout.store.base import EventRecord, MetricRecord

if TYPE_CHECKING:
    from rollout.config import ObserveConfig

MLFLOW_PARAM_MAX_CHARS = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH since MLflow 2.x
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_BAD_CHAR = re.compile(r"[^/\w.\- :]")
_MLFLOW_SPELLED = {"@": "_at_", "^": "_hat_"}


def open_tracker_sinks(
    observe: ObserveConfig, *, run_id: str, run_name: str | None, algorithm: str, run_dir: Path, runs_dir: Path,
    config: Mapping[str, Any],
) -> list[GuardedSink]:
    """The sinks `[observe]` asks for, opened (one that cannot start is reported and left out)."""
    openers: list[tuple[str, Callable[[], RecordSink]]] = []
    if observe.tensorboard:
        openers.append(("tensorboard", lambda: TensorBoardSink(run_dir / "tensorboard", config=config)))
    if (wb := observe.wandb) is not None:
        openers.append(("wandb", lambda: WandbSink(
            run_id=run_id, name=run_name or run_id, project=wb.project, entity=wb.entity, mode=wb.mode,
            save_dir=wb.dir if wb.dir is not None else run_dir, config=config,
        )))
    if (ml := observe.mlflow) is not None:
        uri = ml.tracking_uri if ml.tracking_uri is not None else (runs_dir / "mlruns").resolve().as_uri()
        openers.append(("mlflow", lambda: MlflowSink(
            tracking_uri=uri, experiment=ml.experiment, run_id=run_id, algorithm=algorithm, config=config,
        )))
    sinks = [GuardedSink(name, open_sink) for name, open_sink in openers]
    return [sink for sink in sinks if sink.error is None]


class GuardedSink:
    """A tracker whose failure must not stop the run: the first error (opening, writing or closing)
    is written to stderr once and the tracker is dropped; later batches skip it."""

    def __init__(self, name: str, open_sink: Callable[[], RecordSink]) -> None:
        self.name = name
        self.error: str | None = None
        self._sink: RecordSink | None = None
        try:
            self._sink = open_sink()
        except Exception as err:  # reported on stderr and kept in `error`; the run starts without it
            self._drop("cannot start", err)

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        if self._sink is None:
            return
        try:
            self._sink.write(records)
        except Exception as err:  # reported on stderr and kept in `error`; training goes on
            self._drop("failed", err)

    def close(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        try:
            sink.close()
        except Exception as err:  # reported on stderr and kept in `error`; the run's status stands
            self._drop("failed to close", err)

    def _drop(self, what: str, err: Exception) -> None:
        sink, self._sink = self._sink, None
        message = f"tracker {self.name} {what}: {type(err).__name__}: {err}; the run goes on without it"
        if sink is not None:
            try:
                sink.close()
            except Exception as close_err:  # part of the one report
                message += f" (closing it failed too: {type(close_err).__name__}: {close_err})"
        self.error = message
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


# --------------------------------------------------------------------------- the trackers


class TensorBoardSink:
    """Event files under `log_dir`: a scalar per metric at its step, the config as text."""

    def __init__(self, log_dir: Path, *, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))
        # Indented: TensorBoard renders text as markdown, and this keeps the JSON a code block.
        text = "\n".join("    " + line for line in json.dumps(config, indent=2, sort_keys=True).splitlines())
        self._writer.add_text("config", text, global_step=0)
        self._writer.flush()

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        for record in records:
            if isinstance(record, MetricRecord):
                self._writer.add_scalar(record.name, record.value, global_step=record.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run with the rollout run's id and config; one history row per step."""

    def __init__(
        self, *, run_id: str, name: str, project: str, entity: str | None, mode: str, save_dir: Path,
        config: Mapping[str, Any],
    ) -> None:
        import wandb

        save_dir.mkdir(parents=True, exist_ok=True)
        # console="off": the run's output is its events, in the store; W&B need not wrap stdout.
        self._run = wandb.init(
            project=project, entity=entity, mode=mode, dir=save_dir, id=run_id, name=name, config=dict(config),
            settings=wandb.Settings(console="off"),
        )

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        for step, values in group_metrics_by_step(records):
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run named after the rollout run: config as params and an artifact, metrics by step."""

    def __init__(
        self, *, tracking_uri: str, experiment: str, run_id: str, algorithm: str, config: Mapping[str, Any]
    ) -> None:
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=tracking_uri)
        run = self._client.create_run(
            _mlflow_experiment_id(self._client, experiment), run_name=run_id,
            tags={"rollout.run_id": run_id, "rollout.algorithm": algorithm},
        )
        self._run_id: str = run.info.run_id
        params = [Param(key, value) for key, value in flatten_params(config)]
        for chunk in _chunks(params, MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=chunk)
        self._client.log_dict(self._run_id, dict(config), "rollout-config.json")  # the config, uncut

    def write(self, records: Sequence[EventRecord | MetricRecord]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [
            self._metric(mlflow_metric_name(r.name), r.value, now_ms, r.step)
            for r in records if isinstance(r, MetricRecord)
        ]
        for chunk in _chunks(metrics, MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=chunk)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _mlflow_experiment_id(client: Any, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:  # another run created it in between
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


# --------------------------------------------------------------------------- pure helpers


def group_metrics_by_step(records: Sequence[EventRecord | MetricRecord]) -> list[tuple[int, dict[str, float]]]:
    """The batch's metrics as (step, {name: value}), one entry per run of records at the same step,
    in queue order (a later value of a name at the same step wins)."""
    groups: list[tuple[int, dict[str, float]]] = []
    for record in records:
        if not isinstance(record, MetricRecord):
            continue
        if not groups or groups[-1][0] != record.step:
            groups.append((record.step, {}))
        groups[-1][1][record.name] = record.value
    return groups


def mlflow_metric_name(name: str) -> str:
    """`name` with the characters MLflow refuses spelled out (`@` -> `_at_`, `^` -> `_hat_`) or
    replaced by `_`: `eval/pass@1` -> `eval/pass_at_1`."""
    return _MLFLOW_BAD_CHAR.sub(lambda m: _MLFLOW_SPELLED.get(m.group(0), "_"), name)


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) for every leaf of the config; lists and null as JSON, values cut to
    MLflow's limit (the artifact `rollout-config.json` has them whole)."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_params(value, prefix=f"{dotted}.")
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if len(text) > MLFLOW_PARAM_MAX_CHARS:
            text = text[: MLFLOW_PARAM_MAX_CHARS - 3] + "..."
        yield dotted, text


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
