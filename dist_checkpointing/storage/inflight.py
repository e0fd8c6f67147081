"""Several read requests of one region in flight at once, reported in file order.

O_DIRECT has no readahead, so a few requests are kept outstanding (on one thread pool per
process) while earlier ones are verified; completions are reported in file order, one call
at a time, as with one stream.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, List, Optional

from ..errors import CheckpointCorruptedError

__all__ = ["DEPTH", "read_in_flight", "read_through_slots", "request_pool"]

#: read requests of one region kept in flight with O_DIRECT
DEPTH = 4
#: threads of the per-process request pool (several regions may be read at once)
POOL_THREADS = 8

_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = -1
_pool_lock = threading.Lock()


def request_pool() -> ThreadPoolExecutor:
    """The process's request pool (a forked child makes its own: threads do not survive)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="dc-read-req")
            _pool_pid = os.getpid()
        return _pool


def read_upto(fd: int, offset: int, view: memoryview) -> int:
    """Reads up to `len(view)` bytes at `offset`; fewer only where the file ends."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
        if got % 512:  # the file ended inside a block (O_DIRECT cannot go on from there)
            break
    return done


def _pipeline(
    count: int,
    depth: int,
    read: Callable[[int], int],
    done: Callable[[int, int], bool],
) -> None:
    """Runs `read(i)` for 0..count-1, `depth` at a time, and `done(i, got)` for each in order
    here, until `done` returns False; every started request has finished on return."""
    if depth <= 1 or count <= 1:
        for i in range(count):
            if not done(i, read(i)):
                return
        return
    pool = request_pool()
    pending: Deque[Future] = deque()
    try:
        nxt = 0
        for i in range(count):
            while nxt < count and nxt < i + depth:
                pending.append(pool.submit(read, nxt))
                nxt += 1
            if not done(i, pending.popleft().result()):
                return
    finally:
        for f in pending:
            f.cancel()
        for f in pending:
            if not f.cancelled():
                f.exception()


def read_in_flight(
    fd: int,
    offset: int,
    out: Any,
    path: str,
    progress: Optional[Callable[[int], None]],
    request: int,
    depth: int = DEPTH,
) -> None:
    """Reads `len(out)` bytes at `offset` of `fd` straight into `out`, `depth` at a time.

    Args:
        out: flat uint8 destination (with O_DIRECT, it, `offset` and `request` aligned).
        path: the file's name, for errors.
        progress: called with the leading bytes of `out` filled, in order, never concurrently.
        depth: requests of `request` bytes in flight (1: in the calling thread).

    Raises:
        CheckpointCorruptedError: the file ends before the region does.
        OSError: a request failed.
        Exception: whatever `progress` raised.
    """
    n = len(out)
    view = memoryview(out)
    starts = list(range(0, n, request))

    def read(i: int) -> int:
        s = starts[i]
        e = min(n, s + request)
        got = read_upto(fd, offset + s, view[s:e])
        if got < e - s:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + s + got}")
        return e

    def done(i: int, end: int) -> bool:
        if progress is not None:
            progress(end)
        return True

    _pipeline(len(starts), depth, read, done)


def read_through_slots(
    fd: int,
    offset: int,
    length: int,
    slots: List[memoryview],
    deliver: Callable[[int, memoryview], None],
) -> bool:
    """Reads `length` bytes at `offset` through reusable slots, `len(slots)` in flight,
    handing each to `deliver(file_offset, data)` in file order (`data` valid during the
    call only).

    Returns:
        Whether every byte was read (else the short request was delivered as read).
    """
    size, nslots = len(slots[0]), len(slots)
    ats = list(range(offset, offset + length, size))

    def read(i: int) -> int:
        return read_upto(fd, ats[i], slots[i % nslots][: min(size, offset + length - ats[i])])

    ok = [True]

    def done(i: int, got: int) -> bool:
        deliver(ats[i], slots[i % nslots][:got])
        ok[0] = got == min(size, offset + length - ats[i])
        return ok[0]

    _pipeline(len(ats), nslots, read, done)
    return ok[0]
