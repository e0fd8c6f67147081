"""The host-memory tier: a local checkpoint root on a memory file system (tmpfs, ramfs).

A directory in `/dev/shm` outlives the training processes (a crashed or killed process loses
nothing there) but not the machine. Its files are memory: fsync has nothing to flush and
O_DIRECT is refused, so a manager rooted there writes buffered, without fsync
(`LocalCheckpointManager.in_memory`). Detected from the mount table (`/proc/mounts`): the
file system type of the longest mount point that contains the path.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

__all__ = ["MEMORY_FS_TYPES", "filesystem_type", "is_memory_path"]

logger = logging.getLogger(__name__)

#: file system types whose files live in host memory
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})
_MOUNTS = "/proc/mounts"


def _unescape(field: str) -> str:
    """A mount table field with its octal escapes (`\\040` for a space) decoded."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def filesystem_type(path: Union[str, os.PathLike[str]], mounts: Optional[str] = None) -> str:
    """The type of the file system holding `path` (or, if it does not exist yet, its nearest
    existing parent), from `mounts` (the text of `/proc/mounts`; read when None). '' when
    unknown (no mount table, e.g. not Linux)."""
    if mounts is None:
        try:
            with open(_MOUNTS, encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return ""
    target = os.path.realpath(os.fspath(path))
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1]).rstrip("/") or "/"
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last of equal mount points wins (stacked)
            best, kind = point, fields[2]
    return kind


def is_memory_path(path: Union[str, os.PathLike[str]], mounts: Optional[str] = None) -> bool:
    """Whether `path` lies on a memory file system (tmpfs, ramfs): see the module docstring."""
    return filesystem_type(path, mounts) in MEMORY_FS_TYPES
