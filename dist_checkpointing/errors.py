"""Every exception the library raises, under one root: `CheckpointingException`.

Messages name what is at fault (key, path, rank, or the (action, backend, version)
triple), so a failure in a 1000-rank job can be traced without a debugger.
"""

from __future__ import annotations

__all__ = [
    "CheckpointingException",
    "StrategyNotFoundError",
    "IncompatibleCheckpointError",
    "NotACheckpointError",
    "CheckpointExistsError",
    "ShardingIntegrityError",
    "KeyMismatchError",
    "CheckpointCorruptedError",
    "UnsafeCheckpointError",
    "DistributedFailureError",
    "AsyncSaveError",
]


class CheckpointingException(Exception):
    """Root of every error raised by dist_checkpointing."""


class StrategyNotFoundError(CheckpointingException):
    """No strategy is registered for the requested (action, backend, version)."""


class IncompatibleCheckpointError(CheckpointingException):
    """A strategy cannot read a checkpoint written by another backend or version."""


class NotACheckpointError(CheckpointingException):
    """A path is not a complete checkpoint (missing or invalid metadata.json)."""


class CheckpointExistsError(CheckpointingException):
    """Saving would overwrite an existing complete checkpoint."""


class ShardingIntegrityError(CheckpointingException):
    """Shards across ranks overlap, leave a gap, or disagree on shape or dtype."""


class KeyMismatchError(CheckpointingException):
    """Requested keys and checkpoint keys differ under a raising strict mode."""


class CheckpointCorruptedError(CheckpointingException):
    """Checkpoint content is truncated, malformed or fails verification."""


class UnsafeCheckpointError(CheckpointingException):
    """Loading would unpickle objects outside the safe allowlist."""


class DistributedFailureError(CheckpointingException):
    """One or more other ranks failed a collective step; raised on every rank."""


class AsyncSaveError(CheckpointingException):
    """A background checkpoint write failed, crashed or was killed on some rank."""
