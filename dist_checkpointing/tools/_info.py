"""What `describe` reports, and small helpers; torch-free (used by the fast `_light` reader)."""

from __future__ import annotations

import datetime
import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["TensorInfo", "ChecksumCoverage", "CheckpointInfo", "short_repr", "disk_size", "date_of"]

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxdict = _repr.maxlist = _repr.maxtuple = 4


@dataclass
class TensorInfo:
    """One stored tensor: global shape, dtype, bytes and number of stored shards."""

    key: str
    shape: List[int]
    dtype: str
    nbytes: int
    shards: int


@dataclass
class ChecksumCoverage:
    """How much of a checkpoint `checksums.json` covers (items and bytes)."""

    present: bool
    items: int = 0
    items_covered: int = 0
    bytes: int = 0
    bytes_covered: int = 0
    files_covered: List[str] = field(default_factory=list)


@dataclass
class CheckpointInfo:
    """What `describe` found in a checkpoint directory.

    Attributes:
        path: the directory.
        kind: 'torch_dist' (or another backend named by `metadata.json`), 'dcp', 'local'
            or 'incomplete'.
        complete: whether it is committed (loadable).
        step: from a `iter_NNNNNNN` directory name, else None.
        backend: `sharded_backend v<version>` (or 'dcp' / None).
        size: bytes on disk (all files below the directory).
        date: modification time of the commit record (or of the directory), ISO 8601 UTC.
        tensors: stored tensors (empty when `deep` was False).
        objects: stored objects and common values: key -> short repr ('' when not read).
        checksums: coverage by `checksums.json` (local parts: by their own checksums).
        world_size: ranks that wrote it, when known.
        problem: why it is incomplete or unreadable, else ''.
        latest: whether the root's `latest` record names it.
    """

    path: str
    kind: str
    complete: bool
    step: Optional[int]
    backend: Optional[str]
    size: int
    date: str
    tensors: List[TensorInfo] = field(default_factory=list)
    objects: Dict[str, str] = field(default_factory=dict)
    checksums: Optional[ChecksumCoverage] = None
    world_size: Optional[int] = None
    problem: str = ""
    latest: bool = False

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all stored tensors (global shapes)."""
        return sum(t.nbytes for t in self.tensors)


def short_repr(value: Any) -> str:
    """A one-line repr of at most ~60 characters; tensors as `tensor(shape, dtype)`."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"tensor({tuple(shape)}, {value.dtype})"
    return _repr.repr(value)


def disk_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed while we walk
                pass
    return total


def date_of(path: Path) -> str:
    try:
        stamp = path.stat().st_mtime
    except OSError:
        return ""
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
