"""Reading part of a file region through a mapping of the page cache, without copying it.

A resharded load often needs a strided part of a stored chunk: a column block of a
row-major chunk is a short run of every row. `read` (and O_DIRECT) can only move whole
contiguous ranges, so every rank of the node copies the whole chunk out of the page cache
to keep a quarter of it: on this project's 2-core VM, four ranks loading column blocks of
1 GiB spent 1.4 CPU s each (half of it the kernel's copies) and the load ran at 0.27x the
disk's speed. A mapping shares the page cache's own pages: each rank hashes and copies out
only what it uses, and the node reads every byte from the disk once.

Pages are brought in request by request with `MADV_POPULATE_READ` (Linux 5.14+), which
reads missing pages like a read would (with readahead) and reports an I/O error or a file
shorter than the region as an error instead of the SIGBUS a plain access would raise.
Where the kernel refuses it, `available()` is False and callers read as before. The
mapping is private and never written: no page is copied, nothing reaches the file.

A file truncated by another process while it is mapped (after the region was populated)
would still end this process with SIGBUS when a dropped page is touched again: checkpoint
files are never truncated while a load reads them (they are written once, under another
name, and renamed into place).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..errors import CheckpointCorruptedError
from . import faults

__all__ = ["available", "mapped_region", "MappedRegion"]

logger = logging.getLogger(__name__)

#: `madvise` advice: populate page tables for reading (Linux 5.14); not in `mmap` on 3.11
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_supported: Optional[bool] = None
_lock = threading.Lock()


def available() -> bool:
    """Whether this process can map and populate file regions (checked once)."""
    global _supported
    with _lock:
        if _supported is None:
            _supported = _check()
        return _supported


def _check() -> bool:
    if not hasattr(mmap.mmap, "madvise"):
        return False
    try:
        m = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            m.madvise(MADV_POPULATE_READ, 0, mmap.PAGESIZE)
        finally:
            m.close()
        return True
    except (OSError, ValueError) as e:
        logger.info("page-cache mappings unavailable (%s): resharded reads copy whole ranges", e)
        return False


class MappedRegion:
    """`nbytes` of a file from `offset`, mapped: `array` is valid once `populate` filled it.

    Args:
        mm: the mapping (from the allocation-granularity boundary at or before `offset`).
        skip: where the region starts in the mapping.
        nbytes: the region's size.
        path: the file's name, for errors.
        offset: the region's file offset.
    """

    def __init__(self, mm: mmap.mmap, skip: int, nbytes: int, path: str, offset: int) -> None:
        self._mm, self._skip = mm, skip
        self.nbytes, self.path, self.offset = nbytes, path, offset
        self.array = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=skip)

    def populate(self, progress: Optional[Callable[[int], None]], request: int) -> None:
        """Brings the region into memory in `request`-sized steps, in order.

        Args:
            progress: called after each step with the number of leading bytes ready.
            request: bytes per step.

        Raises:
            CheckpointCorruptedError: the file ends before the region does.
            OSError: an I/O error while reading a page in.
        """
        done = 0
        while done < self.nbytes:
            n = min(request, self.nbytes - done)
            faults.check("read", self.path, self.offset + done, n, False)
            start = self._skip + done
            page0 = start - start % mmap.PAGESIZE
            try:
                self._mm.madvise(MADV_POPULATE_READ, page0, start + n - page0)
            except OSError as e:
                if e.errno == errno.EFAULT:  # past the end of the file
                    raise CheckpointCorruptedError(
                        f"{self.path}: short read at offset {self.offset + done}"
                    ) from e
                raise OSError(
                    e.errno, f"{self.path}: read at offset {self.offset + done}: {e.strerror}"
                ) from e
            done += n
            if progress is not None:
                progress(done)


@contextlib.contextmanager
def mapped_region(path: str, offset: int, nbytes: int) -> Iterator[MappedRegion]:
    """Maps `nbytes` of `path` from `offset` (private, read-only in use) for a `with` block.

    The mapping outlives the block while views of `array` are still referenced (it is
    unmapped when the last one goes).

    Raises:
        CheckpointCorruptedError: the file cannot be opened or is shorter than the region.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot read ({e})") from e
    try:
        size = os.fstat(fd).st_size
        if size < offset + nbytes:
            raise CheckpointCorruptedError(
                f"{path}: short read at offset {size} (the region ends at {offset + nbytes})"
            )
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = max(1, offset + nbytes - base)
        # private and writable: a buffer numpy and torch accept without copying; never
        # written, so every page stays the page cache's own
        mm = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=base)
    finally:
        os.close(fd)
    region: Any = None
    try:
        mm.madvise(mmap.MADV_SEQUENTIAL)
        region = MappedRegion(mm, offset - base, nbytes, path, offset)
        yield region
    finally:
        if region is not None:
            region.array = None
        del region
        with contextlib.suppress(BufferError):  # views still alive: unmapped with the last
            mm.close()
