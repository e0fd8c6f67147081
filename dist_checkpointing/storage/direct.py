"""Positional file I/O: O_DIRECT writes with a buffered fallback, reads through the page cache.
`FileWriter` writes a file in large aligned requests, preallocated, fsync'd once; a
directory whose file system refused O_DIRECT (EINVAL) is written buffered from then on.
Reads are one sequential stream of requests (the kernel reads ahead, and a node's ranks
share what it caches). Every request goes through `faults.check` (the test seam).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from typing import Callable, Optional, Set, Union

import numpy as np
import torch

from ..errors import CheckpointCorruptedError
from . import faults, objstore
from .buffers import aligned

__all__ = [
    "FileWriter",
    "create_new",
    "pwrite_all",
    "read_file",
    "read_region",
    "reset_direct_fallbacks",
]

logger = logging.getLogger(__name__)

#: largest single read request
CHUNK_READ = 32 << 20
PathLike = Union[str, "os.PathLike[str]"]
#: called with how many leading bytes of a destination are filled so far
Progress = Optional[Callable[[int], None]]

_refused: Set[str] = set()  # directories whose file system refused O_DIRECT
_lock = threading.Lock()


def _refuse_direct(directory: str, e: BaseException) -> None:
    """Records that O_DIRECT failed (`e`) in `directory` (logged once)."""
    with _lock:
        if directory in _refused:
            return
        _refused.add(directory)
    logger.info("O_DIRECT is not usable in %s (%s): using buffered writes", directory, e)


def reset_direct_fallbacks() -> None:
    """Forgets every refusal (tests; a remounted file system)."""
    with _lock:
        _refused.clear()


def _pread_into(
    fd: int, path: str, offset: int, view: memoryview, progress: Progress, request: int
) -> None:
    """Fills `view` from `offset` of `fd`, `request` bytes at a time, `progress` after each."""
    done = 0
    while done < len(view):
        end = min(len(view), done + request)
        while done < end:
            got = os.preadv(fd, [view[done:end]], offset + done)
            if got <= 0:
                raise CheckpointCorruptedError(f"{path}: short read at offset {offset + done}")
            done += got
        if progress is not None:
            progress(done)


def read_region(
    path: str, offset: int, out: np.ndarray, progress: Progress = None, request: int = CHUNK_READ
) -> None:
    """Reads `out.size` bytes of `path` from `offset` into `out` (flat uint8, C-contiguous),
    `request` bytes at a time.

    Args:
        progress: called after each request with the leading bytes of `out` filled
            (increasing, the last with `out.size`), to verify them while in the CPU caches.

    Raises:
        CheckpointCorruptedError: the file is shorter than the region, or cannot be read.
    """
    if out.size == 0:
        return
    if objstore.split(path) is not None:
        objstore.read_range(path, offset, out, progress)
        return
    try:
        faults.check("read", path, offset, out.size, False)
        fd = os.open(path, os.O_RDONLY)
        try:
            view = memoryview(out)  # type: ignore[arg-type]
            _pread_into(fd, path, offset, view, progress, request)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: read failed at offset {offset} ({e})") from e


def read_file(path: PathLike) -> torch.Tensor:
    """Reads a whole file into a new uint8 tensor.

    Raises:
        OSError: the file cannot be opened (FileNotFoundError when missing) or read.
        CheckpointCorruptedError: the file shrank while it was being read.
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        faults.check("read", path, 0, size, False)
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]
        _pread_into(fd, path, 0, view, None, max(size, 1))  # one request: no readahead drains
    finally:
        os.close(fd)
    return buffer


#: refuse to open a symlink (0 where the platform has no such flag)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: a new file only: FileExistsError where the name exists (a file or a link)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW


def create_new(path: PathLike, mode: int = 0o644) -> int:
    """Opens a new file for writing (O_CREAT | O_EXCL | O_NOFOLLOW): FileExistsError when
    the name exists, so nothing is ever written through an existing name or link."""
    return os.open(path, _NEW, mode)


def pwrite_all(fd: int, view: memoryview, offset: int, path: str, direct: bool) -> None:
    """Writes all of `view` at `offset` of `fd` (the fault seam sees `path` and `direct`)."""
    limit = faults.check("write", path, offset, len(view), direct)
    if limit is not None:  # an injected crash part-way through this request
        view = view[:limit]
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if limit is not None:
        faults.die()


class FileWriter:
    """Writes one file in positional requests; switches to buffered I/O if O_DIRECT fails.

    Args:
        size: the file's final size (preallocated; `finish` truncates to it).
        direct: try O_DIRECT (requests must then be `ALIGN`ed in offset, length and memory;
            the last may be padded past `size`).
        exclusive: FileExistsError if the name exists (else a name left there, a file or a
            link, is removed first). Either way the file is created new: never opened
            through an existing name or link, so nothing that name pointed to is written.
        overwrite: write over the existing file in place (its blocks reused; `finish`
            truncates it to `size`); FileNotFoundError if it does not exist (a symlink
            there is refused, never followed).
    """

    def __init__(
        self,
        path: PathLike,
        size: int,
        direct: bool,
        exclusive: bool = False,
        preallocate: bool = True,
        overwrite: bool = False,
    ) -> None:
        self.path, self.size = os.fspath(path), size
        self._directory = os.path.dirname(self.path)
        if not (overwrite or exclusive):  # removing a name never changes another name's file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        flags = (os.O_WRONLY | _NOFOLLOW) if overwrite else _NEW
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT") and self._directory not in _refused:
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if isinstance(e, (FileExistsError, FileNotFoundError)):
                    raise
                _refuse_direct(self._directory, e)
        if self.fd < 0:
            self.fd = os.open(self.path, flags, 0o644)
        if preallocate and size and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self.fd, 0, aligned(size))
            except OSError:  # not supported here; the writes allocate as they go
                pass
            except BaseException:
                os.close(self.fd)
                raise

    def write(self, view: memoryview, offset: int) -> None:
        """Writes `view` at `offset` (both aligned when direct; `view` may be padded past EOF)."""
        if self.direct:
            try:
                pwrite_all(self.fd, view, offset, self.path, True)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _refuse_direct(self._directory, e)
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_WRONLY | _NOFOLLOW, 0o644)
                self.direct = False
        pwrite_all(self.fd, view, offset, self.path, False)

    def finish(self, fsync: bool = True) -> None:
        """Truncates the padding of the last aligned request, fsyncs (unless told not to) and
        closes the file."""
        try:
            os.ftruncate(self.fd, self.size)
            if fsync:
                os.fsync(self.fd)
        finally:
            self._close()

    def abort(self, remove: bool = False) -> None:
        """Closes the file after a failure (if still open); `remove` also deletes it."""
        self._close()
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
