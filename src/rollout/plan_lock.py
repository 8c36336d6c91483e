"""The plan lock (`rollout plan -o plan.lock`): what a planned run is pinned to, and the check
`rollout run --plan plan.lock` makes before anything loads.

    pins = files_to_pin(cfg, config_path=Path("examples/sft-tiny.toml"))   # [(path, role)], no imports
    pinned = digest_files(pins)                                             # blake3 of each
    write_lock(lock_dict, Path("plan.lock"))
    cfg, drift = check_lock(Path("plan.lock"))                              # drift: what changed

The lock is JSON (docs/plan-lock.md has every field): `lock_version` (1), the fully resolved
run config (every default filled in, every path absolute) with its digest, a blake3 digest of
every file the run reads (the config itself, each model folder's files, every dataset file,
the `[eval]` data, the source file of every `module:attr` or installed plugin, and a sidecar's
executable and the scripts in its command), the versions of the packages that decide the
numbers, the device, and the plan's findings (lines, lengths, memory estimate).

`check_lock` recomputes the file list from the locked config (a new file in a model folder is
drift too), re-hashes every file and compares package versions and the device. Nothing here
imports torch, transformers or a plugin: a plugin's source file is found with
`importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from rollout.config import RunConfig
from rollout.errors import ConfigError, ModelError
from rollout.plugins import BUILTIN, find_plugin
from rollout.sidecar_config import SidecarConfig

LOCK_VERSION = 1
PACKAGES = (
    "rollout", "torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "pydantic", "blake3",
    "numpy", "peft", "datasets", "accelerate", "vllm",
)
"""Packages whose version is pinned (those installed); `python` is added."""
_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template",
                    "spiece", "sentencepiece")


@dataclass(frozen=True)
class PinnedFile:
    path: Path
    role: str
    """config | model | tokenizer | reference | reward_model | dataset | eval_data | plugin | sidecar"""
    blake3: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "role": self.role, "blake3": self.blake3, "size": self.size}


@dataclass(frozen=True)
class Drift:
    """One thing that differs from the lock, said in a line naming it."""

    what: str
    """"file" | "package" | "device" | "config" """
    message: str


# --------------------------------------------------------------------------- what a run reads


def files_to_pin(cfg: RunConfig, *, config_path: Path) -> list[tuple[Path, str]]:
    """Every file the run reads, with its role, in a stable order (duplicates dropped)."""
    s = cfg.algorithm.settings
    found: list[tuple[Path, str]] = [(config_path.resolve(), "config")]
    model_dir = local_model_dir(s.base_model.uri, s.base_model.revision)
    found += [(path, _model_file_role(path)) for path in _folder_files(model_dir)]
    reference = getattr(s, "reference", None)
    if reference is not None and reference.uri is not None and reference.uri != s.base_model.uri:
        found += [(path, "reference") for path in _folder_files(local_model_dir(reference.uri, None))]
    datasets = s.dataset.sources if s.dataset.kind == "mixture" else (s.dataset,)
    for source in datasets:
        if source.path is not None:
            found += [(path, "dataset") for path in _files_at(source.path)]
    if cfg.eval is not None:
        found.append((cfg.eval.data, "eval_data"))
        found += [(path, "plugin") for path in plugin_sources("env", cfg.eval.env)]
    for entry in getattr(s, "rewards", ()):
        kind = getattr(entry, "kind", "function")
        if kind == "reward_model" and entry.model is not None:
            found += [(path, "reward_model") for path in _folder_files(entry.model)]
        elif kind == "sidecar":
            found += [(path, "sidecar") for path in sidecar_files(entry)]
        elif kind == "function":
            found += [(path, "plugin") for path in plugin_sources("reward", entry.name)]
    env = getattr(s, "env", None)
    if env is not None:
        refs = [("env", env)] if isinstance(env, str) else [("env", env.name), *(("tool", t) for t in env.tools)]
        for kind, ref in refs:
            if isinstance(ref, SidecarConfig):
                found += [(path, "sidecar") for path in sidecar_files(ref)]
            else:
                found += [(path, "plugin") for path in plugin_sources(kind, ref)]
    return list(dict.fromkeys(found))


def local_model_dir(uri: str, revision: str | None) -> Path:
    """The folder a model's files are in: the uri itself, or a hub id's snapshot in the local hub
    cache (plan and run need the files; nothing is downloaded here)."""
    path = Path(uri)
    if path.is_absolute():
        if not path.is_dir():
            raise ModelError(f"model not found: {uri}")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(uri, revision=revision, local_files_only=True))
    except Exception as err:  # not cached, bad id, hub client missing: the plan can't see the files
        raise ModelError(
            f"model {uri!r} is not a local folder and not in the local hub cache ({type(err).__name__});"
            " download it first (or give a folder) so plan can read and pin its files"
        ) from None


def plugin_sources(kind: str, name: str) -> list[Path]:
    """The source file of a plugin reference: an installed plugin's or a `module:attr`'s module.
    Built-ins are part of rollout (pinned by its version): none."""
    plugin = find_plugin(kind, name)  # type: ignore[arg-type]
    if plugin is not None and plugin.origin == BUILTIN:
        return []
    ref = plugin.ref if plugin is not None else name
    module, _, attr = ref.partition(":")
    if not module or not attr:
        return []
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise ConfigError(f"cannot find the source file of module {module!r} ({kind} {name!r})")
    return [Path(spec.origin).resolve()]


def sidecar_files(sidecar: SidecarConfig) -> list[Path]:
    """A sidecar's executable, and every argument that names an existing file in its working
    folder (`["python", "reward.py"]` pins reward.py). Not pinned: a program of the system found on
    PATH (`python`, `node`) and rollout's own interpreter (its version is pinned)."""
    program, *args = sidecar.command
    found = []
    if os.sep in program:
        path = Path(program) if Path(program).is_absolute() else sidecar.cwd / program
        if path.resolve() != Path(sys.executable).resolve():
            found.append(path)
    elif (which := shutil.which(program)) is not None and not _is_system_program(Path(which)):
        found.append(Path(which))
    for arg in args:
        candidate = Path(arg) if Path(arg).is_absolute() else sidecar.cwd / arg
        if not arg.startswith("-") and candidate.is_file():
            found.append(candidate)
    return [path.resolve() for path in found]


def _is_system_program(path: Path) -> bool:
    """An interpreter or tool of the system (`python`, `node`): pinned by neither plan nor lock."""
    return str(path.resolve()).startswith(("/usr/", "/bin/", "/sbin/", "/opt/")) or "/.venv/" in str(path)


def is_under(path: Path, folders: Iterable[Path]) -> bool:
    """`path` is one of `folders` or inside one."""
    return any(path == folder or folder in path.parents for folder in folders)


def _folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not _hidden(p.relative_to(folder)))


def _files_at(path: Path) -> list[Path]:
    return _folder_files(path) if path.is_dir() else [path]


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _model_file_role(path: Path) -> str:
    return "tokenizer" if path.name.startswith(_TOKENIZER_FILES) else "model"


# --------------------------------------------------------------------------- digests and versions


def digest_file(path: Path) -> str:
    """blake3 of a file's bytes (memory-mapped and multi-threaded: model files are large)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


def digest_files(pins: Iterable[tuple[Path, str]]) -> list[PinnedFile]:
    out = []
    for path, role in pins:
        try:
            out.append(PinnedFile(path, role, digest_file(path), path.stat().st_size))
        except OSError as err:
            raise ConfigError(f"{path}: cannot read it to pin it ({role}): {err.strerror or err}") from None
    return out


def package_versions() -> dict[str, str]:
    """Versions of python and of the installed packages in `PACKAGES`."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


# --------------------------------------------------------------------------- the lock file


def write_lock(lock: Mapping[str, Any], out: Path) -> None:
    """Write the lock as indented JSON, atomically (temp file + rename)."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(lock, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"{out}: cannot write the lock: {err.strerror or err}") from None


def read_lock(path: Path) -> dict[str, Any]:
    try:
        lock = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"plan lock not found: {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: not a plan lock ({err})") from None
    if not isinstance(lock, dict) or "lock_version" not in lock:
        raise ConfigError(f"{path}: not a plan lock (no lock_version)")
    if lock["lock_version"] != LOCK_VERSION:
        raise ConfigError(
            f"{path}: lock_version {lock['lock_version']!r} is not supported (this rollout reads {LOCK_VERSION});"
            " plan again with `rollout plan`"
        )
    needs = ("stages",) if lock.get("kind") == "pipeline" else ("config", "config_digest")
    missing = [k for k in (*needs, "files", "packages", "device") if k not in lock]
    if missing:
        raise ConfigError(f"{path}: not a plan lock (missing {', '.join(missing)})")
    return lock


def locked_config(lock: Mapping[str, Any], *, source: Path) -> RunConfig:
    """The lock's resolved config, validated again; its digest must be the one planned."""
    from pydantic import ValidationError

    from rollout.config_base import format_validation_errors

    try:
        cfg = RunConfig.model_validate(lock["config"])
    except ValidationError as err:
        messages = format_validation_errors(err, lock["config"], source=source)
        raise ConfigError(f"{source}: the locked config is no longer valid: {messages[0]}", details=messages[1:]) \
            from None
    if cfg.digest() != lock["config_digest"]:
        raise ConfigError(f"{source}: the locked config does not match its config_digest (was the lock edited?);"
                          " plan again with `rollout plan`")
    return cfg


LOCK_CHECKED_ENV = "ROLLOUT_LOCK_CHECKED"
"""Set by `rollout run --plan` for the torchrun ranks it starts: `lock_stamp` of the lock it has
just checked on this host, so each rank need not hash every pinned file again."""


def lock_stamp(path: Path) -> str:
    """blake3 of the lock file's bytes (a lock edited after the launcher's check stamps otherwise)."""
    return blake3.blake3(Path(path).read_bytes()).hexdigest()


def check_lock(path: Path, *, device_identity: Mapping[str, Any] | None = None) -> tuple[RunConfig, list[Drift]]:
    """The locked config and everything that differs from the lock: each pinned file (changed,
    missing, or a new file the run would read), package versions and, when given, the device."""
    lock = read_lock(path)
    cfg = locked_config(lock, source=path)
    drift: list[Drift] = []
    pinned = {entry["path"]: entry for entry in lock["files"]}
    config_path = next((Path(e["path"]) for e in lock["files"] if e.get("role") == "config"), None)
    now = files_to_pin(cfg, config_path=config_path or path)
    for file_path, role in now:
        entry = pinned.pop(str(file_path), None)
        if entry is None:
            drift.append(Drift("file", f"{file_path}: a {role} file that was not there when planned"))
            continue
        if (changed := file_drift(entry)) is not None:
            drift.append(changed)
    for gone in pinned.values():
        drift.append(Drift("file", f"{gone['path']}: {gone['role']} file pinned but no longer read by the config"))
    drift += check_packages(lock["packages"])
    if device_identity is not None:
        drift += check_device(lock["device"], device_identity)
    return cfg, drift


def file_drift(entry: Mapping[str, Any]) -> Drift | None:
    """A pinned file (`{path, role, blake3}`) that is missing or whose bytes changed."""
    path = Path(entry["path"])
    if not path.is_file():
        return Drift("file", f"{path}: {entry['role']} file missing since planning")
    digest = digest_file(path)
    if digest != entry["blake3"]:
        return Drift("file", f"{path}: {entry['role']} file changed since planning"
                             f" (blake3 {entry['blake3'][:12]}… now {digest[:12]}…)")
    return None


def check_packages(planned: Mapping[str, str]) -> list[Drift]:
    """Every package whose version differs from the lock's, or that was installed or removed since."""
    versions = package_versions()
    return [Drift("package", f"package {name}: {planned.get(name, 'not installed')} when planned,"
                             f" {versions.get(name, 'not installed')} now")
            for name in sorted(planned.keys() | versions.keys()) if planned.get(name) != versions.get(name)]


def check_device(planned: Mapping[str, Any], identity: Mapping[str, Any]) -> list[Drift]:
    """The device, unless it is the one planned on (kind, CPU model or GPU names)."""
    then = {k: planned.get(k) for k in identity}
    if then == dict(identity):
        return []
    return [Drift("device", f"device: planned on {_device_words(then)}, now {_device_words(identity)}")]


def _device_words(identity: Mapping[str, Any]) -> str:
    gpus = identity.get("gpus") or []
    return f"{identity.get('kind')} ({', '.join(gpus) if gpus else identity.get('name')})"
