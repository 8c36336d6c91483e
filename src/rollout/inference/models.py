"""Turn `--model` into a Hugging Face model folder: a folder as-is, a snapshot id exported once and cached.

    resolve_model("local/models/sft-tiny", storage_path=..., object_path=...)    # the folder
    resolve_model("3f2a9c1e", storage_path=Path("rollout.db"), object_path=Path("object-store"))
    # -> object-store/exports/<64-hex id>/ (exported on first use, reused after)

The export cache lives under the object store root in `exports/`, which the
blob tree (two-hex-digit shard folders) and `snapshot gc` never touch. An export
is complete once `rollout_snapshot.json` exists (written last).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import blake3

from rollout.errors import ModelError, StorageError
from rollout.export import export_snapshot
from rollout.store import open_object_store, open_store

_SNAPSHOT_ID = re.compile(r"[0-9a-f]{8,64}")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ResolvedModel:
    """Where the model is, the name to serve it under, and what identifies its contents."""

    path: str
    name: str
    fixed_identity: str | None = None
    """`snapshot:<id>` (or `openai:<url>:<name>`); None: the digest of the folder's files, computed on demand."""

    @cached_property
    def identity(self) -> str:
        """`snapshot:<id>`, or `files:<blake3 of the folder's weights, config and tokenizer>`."""
        return self.fixed_identity or f"files:{digest_model_dir(Path(self.path))}"


def resolve_model(spec: str, *, storage_path: Path, object_path: Path) -> ResolvedModel:
    """A model folder for `spec` (a folder, or a snapshot id / unique prefix of >= 8 hex chars)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: not a model folder (no config.json)")
        resolved = path.resolve()
        return ResolvedModel(str(resolved), resolved.name)
    if _SNAPSHOT_ID.fullmatch(spec):
        return _export_snapshot_model(spec, storage_path=storage_path, object_path=object_path)
    raise ModelError(
        f"model not found: {spec}",
        details=["pass a model folder or a snapshot id (>= 8 hex chars) with --storage-path/--object-path"],
    )


def digest_model_dir(path: Path) -> str:
    """blake3 over the folder's weights, config and tokenizer files (names and bytes, sorted)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    names = sorted(
        {p.name for p in path.glob("*.safetensors")} | {n for n in _MODEL_FILES if (path / n).is_file()}
    )
    for name in names:
        hasher.update(name.encode() + b"\0")
        hasher.update_mmap(path / name)
    return hasher.hexdigest()


def _export_snapshot_model(snapshot_id: str, *, storage_path: Path, object_path: Path) -> ResolvedModel:
    if not storage_path.is_file():
        raise StorageError(
            f"no store at {storage_path}", details=["pass --storage-path (or set ROLLOUT_STORAGE_PATH)"]
        )
    if not object_path.is_dir():
        raise StorageError(
            f"no object store at {object_path}", details=["pass --object-path (or set ROLLOUT_OBJECT_PATH)"]
        )
    store = open_store("embedded", path=storage_path)
    try:
        record = store.get_snapshot(snapshot_id)
        out = object_path / "exports" / record.id
        if not (out / "rollout_snapshot.json").is_file():
            export_snapshot(store, open_object_store("fs", path=object_path), record, out)
    finally:
        store.close()
    return ResolvedModel(str(out.resolve()), f"snapshot-{record.id[:12]}", f"snapshot:{record.id}")
