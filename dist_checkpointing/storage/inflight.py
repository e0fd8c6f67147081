"""Several read requests of one region in flight at once, reported in file order.

O_DIRECT has no readahead: one synchronous stream of requests leaves the device idle while
each request's bytes are copied and verified. With a few requests outstanding it works on
the next ones meanwhile. Requests run on one thread pool per process (made on first use,
again after a fork); completions are reported in file order, one call at a time, so a
caller that verifies or scatters bytes as they land sees the same protocol as with one
stream.
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
    """Runs `read(i)` for requests 0..count-1, `depth` at a time, and `done(i, got)` for each
    in order in the calling thread; stops when `done` returns False.

    Every started request has finished when this returns or raises, so nothing writes into
    the caller's memory afterwards.
    """
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
        fd: an open file (with O_DIRECT, `offset`, `request` and `out` aligned as it requires).
        offset: where the region starts.
        out: flat uint8 destination (numpy array).
        path: the file's name, for errors.
        progress: called with the number of leading bytes of `out` filled, increasing, the
            last call with `len(out)`; never concurrently.
        request: bytes per request.
        depth: requests in flight (1: one synchronous stream in the calling thread).

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
    """Reads `length` bytes at `offset` through reusable slots, `len(slots)` in flight.

    For reads that cannot land in their destination directly (O_DIRECT into unaligned
    memory): each request fills one slot on the request pool while the calling thread hands
    earlier ones to `deliver(file_offset, data)`, in file order (`data` valid only during
    the call); a slot is reused once its delivery returned.

    Returns:
        True when every byte was read; False when the file ended first (the short request
        is delivered with what it read).
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
