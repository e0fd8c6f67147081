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
`madvise` is called through the C library so that the GIL is free while the disk reads,
and a helper thread can populate a few requests ahead while the caller hashes and copies
the last (`populate(..., ahead=)`): reading and using the bytes taking turns left the disk
idle half the time (2 ranks loading column blocks of 4 GiB: 3.3-5.0 s, 2.4-3.2 s ahead).
Where the kernel refuses it, `available()` is False and callers read as before. The
mapping is private and never written: no page is copied, nothing reaches the file.

A file truncated by another process while it is mapped (after the region was populated)
would still end this process with SIGBUS when a dropped page is touched again: checkpoint
files are never truncated while a load reads them (they are written once, under another
name, and renamed into place).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..errors import CheckpointCorruptedError
from . import faults
from .direct import libc_function

__all__ = ["available", "mapped_region", "MappedRegion"]

logger = logging.getLogger(__name__)

#: `madvise` advice: populate page tables for reading (Linux 5.14); not in `mmap` on 3.11
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_supported: Optional[bool] = None
_lock = threading.Lock()
#: `madvise`'s ctypes argument types (address, length, advice)
_MADVISE_ARGS = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


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
        self._base = int(self.array.ctypes.data) - skip  # the mapping's address

    def populate(
        self, progress: Optional[Callable[[int], None]], request: int, ahead: int = 0
    ) -> None:
        """Brings the region into memory in `request`-sized steps, in order.

        Args:
            progress: called after each step with the number of leading bytes ready.
            request: bytes per step.
            ahead: with `progress`, steps a helper thread may populate beyond the bytes
                `progress` was last told of, so that the disk reads the next requests
                while `progress` hashes and copies the last (0: one thread, reading and
                `progress` taking turns, the disk idle during `progress`).

        Raises:
            CheckpointCorruptedError: the file ends before the region does.
            OSError: an I/O error while reading a page in.
            Whatever `progress` raises (the helper stops before the error propagates).
        """
        if ahead <= 0 or progress is None or self.nbytes <= request:
            for done in self._steps(request):
                if progress is not None:
                    progress(done)
            return
        self._populate_ahead(progress, request, ahead)

    def _steps(self, request: int, stop: Optional[threading.Event] = None) -> Iterator[int]:
        """Populates step by step, yielding the number of leading bytes ready after each."""
        done = 0
        while done < self.nbytes and not (stop is not None and stop.is_set()):
            n = min(request, self.nbytes - done)
            faults.check("read", self.path, self.offset + done, n, False)
            start = self._skip + done
            page0 = start - start % mmap.PAGESIZE
            try:
                self._advise(page0, start + n - page0)
            except OSError as e:
                if e.errno == errno.EFAULT:  # past the end of the file
                    raise CheckpointCorruptedError(
                        f"{self.path}: short read at offset {self.offset + done}"
                    ) from e
                raise OSError(
                    e.errno, f"{self.path}: read at offset {self.offset + done}: {e.strerror}"
                ) from e
            done += n
            yield done

    def _populate_ahead(self, progress: Callable[[int], None], request: int, ahead: int) -> None:
        """`populate` with a helper thread reading up to `ahead` steps ahead of `progress`."""
        cond = threading.Condition()
        stop = threading.Event()
        state: dict = {"ready": 0, "told": 0, "error": None, "over": False}

        def fill() -> None:
            try:
                for done in self._steps(request, stop):
                    with cond:
                        state["ready"] = done
                        cond.notify_all()
                        while not stop.is_set() and done - state["told"] >= ahead * request:
                            cond.wait()
            except BaseException as e:  # handed to the caller's thread, raised there
                state["error"] = e
            finally:
                with cond:
                    state["over"] = True
                    cond.notify_all()

        helper = threading.Thread(target=fill, name="dc-populate", daemon=True)
        helper.start()
        try:
            while state["told"] < self.nbytes:
                with cond:
                    while state["ready"] <= state["told"] and not state["over"]:
                        cond.wait()
                    ready = state["ready"]
                if ready <= state["told"]:  # the helper stopped short: its error says why
                    break
                told = state["told"]
                while told < ready:  # step by step: each step's bytes are still in the caches
                    told = min(told + request, ready)
                    progress(told)
                    with cond:
                        state["told"] = told
                        cond.notify_all()
        finally:
            stop.set()
            with cond:
                cond.notify_all()
            helper.join()
        if state["error"] is not None:
            raise state["error"]
        if state["told"] < self.nbytes:  # cannot happen without an error; never pass silently
            raise CheckpointCorruptedError(
                f"{self.path}: read stopped at offset {self.offset + state['told']}"
            )

    def _advise(self, start: int, length: int) -> None:
        """`MADV_POPULATE_READ` on `length` bytes of the mapping from `start` (a page
        boundary), without holding the GIL where the C library's `madvise` can be called.

        ctypes lets go of the GIL during the call; `mmap.madvise` holds it, so a populate
        waiting on the disk stopped the process's other reading threads from hashing and
        copying (a thread spinning beside a cold 1 GiB populate ran at 45% of its idle
        rate, 100% through ctypes).
        """
        fn = libc_function("madvise", _MADVISE_ARGS)
        if fn is None:
            self._mm.madvise(MADV_POPULATE_READ, start, length)
            return
        if fn(self._base + start, length, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


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
