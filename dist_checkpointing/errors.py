"""Every exception the library raises, under one root: `CheckpointingException`."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = [
    "CheckpointingException",
    "StrategyNotFoundError",
    "IncompatibleCheckpointError",
    "NotACheckpointError",
    "CheckpointExistsError",
    "CheckpointClaimedError",
    "ShardingIntegrityError",
    "KeyMismatchError",
    "CheckpointCorruptedError",
    "UnsafeCheckpointError",
    "DistributedFailureError",
    "AsyncSaveError",
    "RankLostAfterCommitError",
    "NoReplicasAvailableError",
    "SameMachineReplicationException",
    "NoUsableCheckpointError",
    "UnsupportedShardedObjectError",
    "LossyDtypeConversionError",
    "close_matches",
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


class CheckpointClaimedError(CheckpointingException):
    """Another save (another job, or a dead one's leftover) holds the directory's claim."""


class ShardingIntegrityError(CheckpointingException):
    """Shards across ranks overlap, leave a gap, or disagree on shape or dtype."""


class KeyMismatchError(CheckpointingException):
    """Requested keys and checkpoint keys differ under a raising strict mode."""


class LossyDtypeConversionError(CheckpointingException):
    """A load would convert a stored dtype to one that cannot hold its values exactly."""


class CheckpointCorruptedError(CheckpointingException):
    """Checkpoint content is truncated, malformed or fails verification."""


class UnsafeCheckpointError(CheckpointingException):
    """Loading would unpickle objects outside the safe allowlist."""


class DistributedFailureError(CheckpointingException):
    """One or more other ranks failed a collective step; raised on every rank."""


class RankLostAfterCommitError(DistributedFailureError):
    """A rank failed after the commit marker was written: the checkpoint is complete."""


class AsyncSaveError(CheckpointingException):
    """A background checkpoint write failed, crashed or was killed on some rank."""


class NoReplicasAvailableError(CheckpointingException):
    """No rank holds a usable copy of a local checkpoint part that a rank needs."""


class SameMachineReplicationException(CheckpointingException):
    """A part of this local checkpoint iteration is already stored here (saved before).

    Args:
        ckpt_id: the part that exists, as `(iteration, owner rank, session id)`, or a message.
    """

    def __init__(self, ckpt_id: Any) -> None:
        self.ckpt_id = ckpt_id
        text = (
            ckpt_id
            if isinstance(ckpt_id, str)
            else f"local checkpoint {describe_ckpt_id(ckpt_id)} already exists on this machine"
        )
        super().__init__(text)


class NoUsableCheckpointError(CheckpointingException):
    """A checkpoint manager found no checkpoint it could load (each candidate and why)."""


def describe_ckpt_id(ckpt_id: Any) -> str:
    """'iteration I, rank R[, session S]' for a local checkpoint id (for messages)."""
    try:
        iteration, owner, session = ckpt_id
    except (TypeError, ValueError):
        return repr(ckpt_id)
    return f"iteration {iteration}, rank {owner}" + (f", session {session!r}" if session else "")


class UnsupportedShardedObjectError(CheckpointingException):
    """A state dict leaf looks like a sharded object but cannot be saved or loaded as one."""


def close_matches(key: str, available: Iterable[str], n: int = 5) -> str:
    """A message suffix naming up to `n` keys of `available` like `key` ('' if none)."""
    found = difflib.get_close_matches(key, list(available), n=n, cutoff=0.6)
    if not found:
        return ""
    return f" (closest keys in the checkpoint: {', '.join(repr(k) for k in found)})"
