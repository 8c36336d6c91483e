"""The error hierarchy.

Everything a user can cause (bad config, bad data line, missing snapshot, a
corrupted blob) is a `RolloutError`: the CLI prints its message as one line on
stderr and exits 2. Anything else is a bug and exits 1.
"""

from __future__ import annotations


class RolloutError(Exception):
    """A user-facing error. `str(err)` is the one-line message; `details` follow it."""

    def __init__(self, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.details: list[str] = list(details or [])


class ConfigError(RolloutError):
    """The run config is invalid (unknown key, wrong type, out of range, ...)."""


class DataError(RolloutError):
    """A dataset is missing or one of its lines is malformed (`file:line: ...`)."""


class ModelError(RolloutError):
    """A model or tokenizer can't be loaded or lacks something the run needs."""


class StorageError(RolloutError):
    """The metadata store or the object store failed or holds bad data."""


class BlobNotFound(StorageError):
    """A blob digest is not in the object store."""


class BlobCorrupted(StorageError):
    """A blob's bytes don't hash to its digest."""


class RunNotFound(StorageError):
    """No run has the given id."""


class SnapshotNotFound(StorageError):
    """No snapshot matches the given id or prefix (or the prefix is ambiguous)."""


class AlgorithmError(RolloutError):
    """The algorithm can't proceed (e.g. loss became NaN, resume from the wrong kind)."""


class DistributedError(RolloutError):
    """A multi-process job can't go on (a peer rank died, torchrun stopped this rank, a batch that
    does not split over the ranks)."""


class EvalNotFound(StorageError):
    """No eval matches the given id or prefix (or the prefix is ambiguous)."""
