"""Pipelines: one file chains training runs, each stage's exported model feeding the next.

    # pipeline.toml (relative paths from this file's folder)
    schema_version = 1
    [[stages]]
    name = "sft"
    config = "sft-tiny.toml"             # exports with [algorithm.sft.export] dir
    [[stages]]
    name = "rm"
    config = "rm-tiny.toml"
    base_model = "sft"                   # base_model.uri <- stage sft's export
    [[stages]]
    name = "ppo"
    config = "ppo-rm-tiny.toml"
    base_model = "sft"
    reward_model = "rm"                  # its [[rewards]] kind = "reward_model" entry <- stage rm's export

    rollout plan --config pipeline.toml -o pipeline.lock   # plans every stage
    rollout run --plan pipeline.lock                       # runs them in order; run it again after a failure

`plan_pipeline` plans every stage with `rollout.plan.make_plan`. A model a stage takes from an
earlier one does not exist yet, so its checks (tokenizer, template, lengths, memory) run on a
stand-in: the model that earlier stage starts from (an SFT or DPO export keeps its base model's
tokenizer and shape), or for a reward model a folder holding that model's config.json as a
1-logit classifier. Stand-ins are never pinned; each stage's lock entry holds its config as it
will run (the real export folders in it) and the digests of every other file it reads.

`run_pipeline` re-checks every pinned file, package and the device up front, then runs the
stages in order through `run_stage` (`rollout train`'s code path). A finished stage is recorded
in `<lock>.progress.json` with its run and the digests of its export; a later invocation skips
it (after checking its export is unchanged: an edited export is drift, refused) and goes on
with the first unfinished stage, resuming it from the newest train_state snapshot of its last
unfinished run in the store when there is one.
"""

from __future__ import annotations

import json
import os
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3
from pydantic import Field, ValidationError, model_validator

from rollout.algorithms.registry import TrainResult
from rollout.config import RunConfig
from rollout.config_base import ConfigPath, StrictModel, format_validation_errors
from rollout.errors import ConfigError
from rollout.plan import Plan, make_plan
from rollout.plan_lock import (
    LOCK_VERSION,
    Drift,
    digest_file,
    digest_files,
    file_drift,
    files_to_pin,
    is_under,
    write_lock,
)

Input = Literal["base_model", "reference", "reward_model"]
INPUTS: tuple[Input, ...] = ("base_model", "reference", "reward_model")


class PipelineStage(StrictModel):
    """One run of the pipeline and the earlier stages whose exported models it takes."""

    name: str = Field(pattern=r"^[A-Za-z][\w-]*$", max_length=64, description="Stage name (unique).")
    config: ConfigPath = Field(description="The stage's run config (TOML), relative to the pipeline file.")
    base_model: str | None = Field(None, description="Take base_model.uri from this earlier stage's export.")
    reference: str | None = Field(None, description="Take reference.uri from this earlier stage's export.")
    reward_model: str | None = Field(
        None, description='Take the model of the [[rewards]] kind = "reward_model" entry from this earlier rm stage.'
    )


class PipelineConfig(StrictModel):
    """Stages run in order; each may take models exported by earlier ones."""

    schema_version: Literal[1] = Field(description="Pipeline file format version; must be 1.")
    stages: tuple[PipelineStage, ...] = Field(min_length=1, description="[[stages]] blocks, in run order.")

    @model_validator(mode="after")
    def _wired_to_earlier_stages(self) -> PipelineConfig:
        seen: list[str] = []
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"two stages are named {stage.name!r}")
            for key in INPUTS:
                source = getattr(stage, key)
                if source is not None and source not in seen:
                    raise ValueError(f"stage {stage.name!r}: {key} = {source!r} is not an earlier stage")
            seen.append(stage.name)
        return self


def is_pipeline_file(path: Path) -> bool:
    """A TOML file with [[stages]] and no [algorithm] (anything else is read as a run config)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return "stages" in data and "algorithm" not in data


def load_pipeline(path: Path) -> PipelineConfig:
    text, data = _read_toml(path)
    try:
        return PipelineConfig.model_validate(data, context={"base_dir": path.parent.resolve()})
    except ValidationError as err:
        messages = format_validation_errors(err, data, text=text, source=path)
        raise ConfigError(messages[0], details=messages[1:]) from None


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class StagePlan:
    name: str
    config_path: Path
    plan: Plan
    """The plan of the stage as validated with stand-ins for the models earlier stages produce."""
    config: dict[str, Any]
    """The resolved config as it will run: the earlier stages' export folders in place of the stand-ins."""
    config_digest: str
    inputs: dict[str, dict[str, str]]
    """{input: {"stage", "path"}}: what the stage takes from earlier stages."""


def plan_pipeline(path: Path) -> tuple[PipelineConfig, list[StagePlan]]:
    """Plan every stage (module docstring); a `RolloutError` names the stage's own config file."""
    pipeline = load_pipeline(path)
    outputs: dict[str, Path | None] = {}
    starts_from: dict[str, str] = {}  # the model a stage's checks ran on (a stand-in for a produced one)
    kinds: dict[str, str] = {}
    plans: list[StagePlan] = []
    with _stand_ins() as make_rm_stand_in:
        for stage in pipeline.stages:
            text, data = _read_toml(stage.config)
            kind = _algorithm_kind(data, stage.config)
            real: dict[Input, Path] = {}
            stand_ins: list[Path] = []
            for key in INPUTS:
                source = getattr(stage, key)
                if source is None:
                    continue
                real[key] = _export_of(source, outputs, stage, key)
                if key == "reward_model":
                    if kinds[source] != "rm":
                        raise ConfigError(f"stage {stage.name!r}: reward_model = {source!r} is a {kinds[source]} stage,"
                                          " not rm")
                    stand_in = make_rm_stand_in(Path(starts_from[source]))
                else:
                    stand_in = Path(starts_from[source])
                stand_ins.append(stand_in)
                _set_input(data, kind, key, str(stand_in), stage.config)
            cfg = _validate_stage(data, text, stage.config)
            plan = make_plan(stage.config, config=cfg, produced=stand_ins)
            settings = cfg.algorithm.settings
            outputs[stage.name] = settings.export.dir if settings.export is not None else None
            starts_from[stage.name] = settings.base_model.uri
            kinds[stage.name] = kind
            config = cfg.model_dump(mode="json")
            for key, folder in real.items():
                _set_input(config, kind, key, str(folder), stage.config)
            plans.append(StagePlan(
                stage.name, stage.config, plan, config, _digest(config),
                {key: {"stage": getattr(stage, key), "path": str(folder)} for key, folder in real.items()},
            ))
    return pipeline, plans


def pipeline_lock(path: Path, plans: list[StagePlan]) -> dict[str, Any]:
    """The lock of a pipeline: the pipeline file's pin and one entry per stage (docs/plan-lock.md)."""
    first = plans[0].plan.lock()
    stages = []
    for stage in plans:
        entry = stage.plan.lock()
        for key in ("lock_version", "created_at", "rollout_version", "packages", "device"):
            entry.pop(key)
        entry |= {"name": stage.name, "config": stage.config, "config_digest": stage.config_digest,
                  "inputs": stage.inputs}
        stages.append(entry)
    return {
        "lock_version": LOCK_VERSION, "kind": "pipeline", "created_at": first["created_at"],
        "rollout_version": first["rollout_version"], "pipeline_path": str(path.resolve()),
        "files": [f.to_dict() for f in digest_files([(path.resolve(), "pipeline")])],
        "packages": first["packages"], "device": first["device"], "stages": stages,
    }


# --------------------------------------------------------------------------- running


def check_pipeline_files(lock: dict[str, Any]) -> list[Drift]:
    """Every file pinned by the pipeline or one of its stages, re-hashed."""
    entries = {e["path"]: e for e in [*lock["files"], *(e for stage in lock["stages"] for e in stage["files"])]}
    return [drift for entry in entries.values() if (drift := file_drift(entry)) is not None]


def run_pipeline(
    lock_path: Path, lock: dict[str, Any], run_stage: Callable[[RunConfig, str | None], TrainResult],
    echo: Callable[[str], None],
) -> None:
    """Run the stages not finished yet, in order (module docstring). The caller has checked the
    pinned files, packages and device."""
    progress_path = lock_path.with_name(lock_path.name + ".progress.json")
    progress = _read_progress(progress_path)
    produced: list[Path] = []
    for stage in lock["stages"]:
        name = stage["name"]
        produced += [Path(i["path"]) for i in stage["inputs"].values()]
        done = progress.get(name)
        if done is not None and done["config_digest"] == stage["config_digest"]:
            _check_outputs(name, done)
            echo(f"stage {name}: done in run {done['run_id']}, skipped")
            continue
        cfg = _stage_config(stage, lock_path)
        _check_new_files(stage, cfg, produced)
        resume = _resume_point(cfg)
        echo(f"stage {name}: {stage['algorithm']}" + (f", resuming from snapshot {resume}" if resume else ""))
        result = run_stage(cfg, resume)
        export = cfg.algorithm.settings.export
        outputs = {} if export is None else {
            str(p): digest_file(p) for p in sorted(export.dir.rglob("*")) if p.is_file()}
        progress[name] = {"config_digest": stage["config_digest"], "run_id": result.run_id,
                          "final_snapshot_id": result.final_snapshot_id, "outputs": outputs}
        write_lock({"stages": progress}, progress_path)
    echo(f"pipeline done: {len(lock['stages'])} stages ({' -> '.join(s['name'] for s in lock['stages'])})")


def _stage_config(stage: dict[str, Any], source: Path) -> RunConfig:
    try:
        cfg = RunConfig.model_validate(stage["config"])
    except ValidationError as err:
        messages = format_validation_errors(err, stage["config"], source=source)
        raise ConfigError(f"{source}: stage {stage['name']}: {messages[0]}", details=messages[1:]) from None
    if cfg.digest() != stage["config_digest"]:
        raise ConfigError(f"{source}: stage {stage['name']}: the locked config does not match its digest"
                          " (was the lock edited?); plan again")
    return cfg


def _check_new_files(stage: dict[str, Any], cfg: RunConfig, produced: list[Path]) -> None:
    """Now that the stage's inputs exist its config resolves: it must read no file it didn't pin."""
    pinned = {entry["path"] for entry in stage["files"]}
    config_path = Path(stage["config_path"])
    for path, role in files_to_pin(cfg, config_path=config_path):
        if not is_under(path, produced) and str(path) not in pinned:
            raise ConfigError(f"stage {stage['name']}: {path}: a {role} file that was not there when planned;"
                              " plan again")


def _check_outputs(name: str, done: dict[str, Any]) -> None:
    for path, digest in done["outputs"].items():
        if not Path(path).is_file():
            raise ConfigError(f"stage {name}: {path}: its exported file is gone; delete the stage from the"
                              " progress file or plan again")
        if digest_file(Path(path)) != digest:
            raise ConfigError(f"stage {name}: {path}: its exported file changed since the stage ran")


def _resume_point(cfg: RunConfig) -> str | None:
    """The newest train_state snapshot of the newest unfinished run of this very config."""
    from rollout.store import open_store

    st = cfg.storage
    if st.backend == "embedded" and not st.embedded.path.is_file():
        return None
    store = open_store(st.backend, path=st.embedded.path if st.backend == "embedded" else None,
                       dsn=st.postgres.dsn if st.postgres is not None else None)
    try:
        digest = cfg.digest()
        for run in store.list_runs():
            if run.config_digest != digest:
                continue
            if run.status == "succeeded":
                return None
            snapshots = store.list_snapshots(run_id=run.id, kind="train_state", limit=1)
            if snapshots:
                return snapshots[0].id
    finally:
        store.close()
    return None


# --------------------------------------------------------------------------- helpers


def _read_toml(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config: {err}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def _algorithm_kind(data: dict[str, Any], source: Path) -> str:
    algorithm = data.get("algorithm")
    kind = algorithm.get("kind") if isinstance(algorithm, dict) else None
    if not isinstance(kind, str) or not isinstance(algorithm.get(kind), dict):
        raise ConfigError(f"{source}: a stage config needs [algorithm] kind and its [algorithm.<kind>] block")
    return kind


def _export_of(source: str, outputs: dict[str, Path | None], stage: PipelineStage, key: str) -> Path:
    folder = outputs[source]
    if folder is None:
        raise ConfigError(f"stage {stage.name!r} takes its {key} from stage {source!r}, which exports nothing:"
                          f" give stage {source!r} an [algorithm.<kind>.export] dir")
    return folder


def _set_input(data: dict[str, Any], kind: str, key: Input, value: str, source: Path) -> None:
    """Point a stage's base_model.uri, reference.uri or reward model entry at `value`."""
    block = data["algorithm"][kind]
    if key in ("base_model", "reference"):
        table = block.get(key) or {}
        block[key] = {**table, "uri": value}
        return
    entries = [e for e in block.get("rewards") or [] if isinstance(e, dict) and e.get("kind") == "reward_model"]
    if len(entries) != 1:
        raise ConfigError(f"{source}: reward_model from a stage needs exactly one [[algorithm.{kind}.rewards]]"
                          f' entry with kind = "reward_model" (found {len(entries)})')
    entries[0]["model"] = value
    entries[0]["snapshot"] = None


def _validate_stage(data: dict[str, Any], text: str, source: Path) -> RunConfig:
    try:
        return RunConfig.model_validate(data, context={"base_dir": source.parent.resolve()})
    except ValidationError as err:
        messages = format_validation_errors(err, data, text=text, source=source)
        raise ConfigError(messages[0], details=messages[1:]) from None


@contextmanager
def _stand_ins() -> Iterator[Callable[[Path], Path]]:
    """make(model_dir) -> a folder whose config.json is `model_dir`'s as a 1-logit classifier: what
    a reward model trained from it will look like, for the checks of a stage that scores with it."""
    with tempfile.TemporaryDirectory(prefix="rollout-plan-") as tmp:
        def make(model_dir: Path) -> Path:
            config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
            arch = str((config.get("architectures") or ["Model"])[0])
            config["architectures"] = [arch.removesuffix("ForCausalLM") + "ForSequenceClassification"]
            config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
            folder = Path(tmp) / f"rm-{len(os.listdir(tmp))}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            return folder

        yield make


def _digest(config: dict[str, Any]) -> str:
    return blake3.blake3(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_progress(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        stages: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["stages"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path}: not a pipeline progress file ({err}); delete it to run every stage") from None
    return stages
