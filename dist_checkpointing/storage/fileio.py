"""File I/O for local and object paths alike: durable writes (atomic replace through a temp
file, fsync of data and directory) and reads (whole small files, byte ranges)."""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..errors import CheckpointCorruptedError
from . import faults, objstore
from .direct import PathLike, create_new

__all__ = ["atomic_write", "fsync_dir", "read_capped", "RangeFile", "open_read"]


def fsync_dir(path: PathLike) -> None:
    """Makes a directory's entries (created/renamed files) durable (objects: already)."""
    if objstore.split(path) is not None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_capped(path: PathLike, limit: int) -> Optional[bytes]:
    """Reads a whole (small) file, refusing to read more than `limit` bytes.

    Returns:
        The bytes, or None when the file (or its directory) does not exist.

    Raises:
        CheckpointCorruptedError: the file cannot be read or is larger than `limit`.
    """
    try:
        if objstore.split(path) is not None:
            raw = objstore.read_object(path, limit)
            if raw is None:
                return None
        else:
            with open(path, "rb") as f:  # read(n) allocates n bytes first: ask for the size
                raw = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot be read ({e})") from e
    if len(raw) > limit:
        raise CheckpointCorruptedError(f"{path} is larger than {limit} bytes")
    return raw


def atomic_write(
    path: PathLike, write_fn: Callable[[io.BufferedWriter], Any], sync: bool = True
) -> None:
    """Writes a file so that readers see either the old content or all of the new one (temp
    file, fsync, rename, directory fsync; an object: one PUT); on failure `path` is untouched.

    Args:
        write_fn: called with the open binary temp file; writes the content.
        sync: False to skip both fsyncs (the file may be lost in a crash, never torn).
    """
    if objstore.split(path) is not None:
        buf = io.BytesIO()
        write_fn(buf)  # type: ignore[arg-type]
        objstore.put_object(path, buf.getvalue())
        return
    path = Path(path)
    # a name of its own, created new: a file or link left at any name is never written
    # through, and the rename replaces the entry at `path` (never what it pointed to)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with os.fdopen(create_new(tmp), "wb") as f:
            write_fn(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    faults.check("replaced", str(path), 0, 0, False)  # the test seam: a file just put in place
    if sync:
        fsync_dir(path.parent)


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of `size` bytes from `offset` of `source`: an open binary
    file, or an object's path (each read a ranged GET)."""

    def __init__(self, source: Any, offset: int, size: int) -> None:
        self._src, self._start, self._pos, self.size = source, offset, 0, size

    def readable(self) -> bool:
        return True

    seekable = readable

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, min(self.size, (0, self._pos, self.size)[whence] + pos))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self._pos)
        if n <= 0:
            return 0
        view = memoryview(b).cast("B")[:n]
        if isinstance(self._src, (str, os.PathLike)):
            objstore.read_range(
                self._src, self._start + self._pos, np.frombuffer(view, dtype=np.uint8)
            )
        else:
            self._src.seek(self._start + self._pos)
            n = self._src.readinto(view)
        self._pos += n
        return n


def open_read(path: Any) -> io.BufferedReader:
    """A file opened for reading (an object: ranged GETs of 8 MiB)."""
    if objstore.split(path) is None:
        return open(path, "rb")
    raw = RangeFile(path, 0, objstore.stat(path)[0])
    return io.BufferedReader(raw, max(1, min(8 << 20, raw.size)))
