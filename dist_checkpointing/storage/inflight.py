"""Several read requests of one region in flight at once, reported in order.

One stream of synchronous requests leaves a (virtual) disk idle between requests and keeps
its queue one deep; with a few requests outstanding the device works on the next while the
previous one is copied and verified. On this project's CI VM, with other jobs using the
disk, two processes reading 512 MiB each measured 0.09-0.19 GB/s with one stream of 8 MiB
requests and 0.33-0.40 GB/s with four in flight (see docs/performance.md).

Requests run on one pool of threads per process (created on first use, again after a
fork); completions are reported to `progress` in file order (the leading bytes filled),
one call at a time, so callers that verify or scatter bytes as they land see the same
protocol as with a single stream.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointCorruptedError

__all__ = [
    "DEPTH",
    "read_in_flight",
    "read_spans_through_slots",
    "read_through_slots",
    "read_upto",
    "request_pool",
]

#: read requests of one region kept in flight
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


def _read_exact(fd: int, offset: int, view: memoryview, path: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + done}")
        done += got


def _settle(pending: Deque[Future]) -> None:
    """Cancels the requests not started yet and waits for the others (their errors are
    the caller's to report, or already superseded by the one being raised)."""
    for f in pending:
        f.cancel()
    for f in pending:
        if not f.cancelled():
            f.exception()


class _InOrder:
    """Reports the leading bytes filled as requests complete: one call per request, in
    file order, one call at a time."""

    def __init__(
        self, spans: List[Tuple[int, int]], progress: Optional[Callable[[int], None]]
    ) -> None:
        self.spans, self.progress = spans, progress
        self.finished = [False] * len(spans)
        self.next = 0  # first request not yet reported
        self.lock = threading.Lock()

    def complete(self, i: int) -> None:
        with self.lock:
            self.finished[i] = True
            # one call per request (a caller verifies request by request, as with one stream)
            while self.next < len(self.spans) and self.finished[self.next]:
                self.next += 1
                if self.progress is not None:
                    self.progress(self.spans[self.next - 1][1])


def read_in_flight(
    fd: int,
    offset: int,
    out: Any,
    path: str,
    progress: Optional[Callable[[int], None]],
    request: int,
    depth: int = DEPTH,
) -> None:
    """Reads `len(out)` bytes at `offset` of `fd` into `out`, `depth` requests at a time.

    Args:
        fd: an open file (O_DIRECT or not: with O_DIRECT, `offset`, `request` and `out`
            must be aligned as it requires).
        offset: where the region starts.
        out: flat uint8 destination (numpy array).
        path: the file's name, for errors.
        progress: called with the number of leading bytes of `out` filled, increasing,
            the last call with `len(out)`; never concurrently.
        request: bytes per request.
        depth: requests in flight (1: one synchronous stream, in the calling thread).

    Raises:
        CheckpointCorruptedError: the file ends before the region does.
        OSError: a request failed (after every request already started has finished,
            so nothing writes into `out` once this returns or raises).
        Exception: whatever `progress` raised (same guarantee).
    """
    n = len(out)
    view = memoryview(out)
    spans = [(s, min(n, s + request)) for s in range(0, n, request)]
    order = _InOrder(spans, progress)
    if depth <= 1 or len(spans) <= 1:
        for i, (s, e) in enumerate(spans):
            _read_exact(fd, offset + s, view[s:e], path)
            order.complete(i)
        return

    def one(i: int) -> None:
        s, e = spans[i]
        _read_exact(fd, offset + s, view[s:e], path)
        order.complete(i)

    pool = request_pool()
    pending: Deque[Future] = deque()
    try:
        for i in range(len(spans)):
            if len(pending) >= depth:
                pending.popleft().result()
            pending.append(pool.submit(one, i))
        while pending:
            pending.popleft().result()
    finally:
        # on an error, let started requests finish: none may write into `out` afterwards
        _settle(pending)


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


def read_through_slots(
    fd: int,
    offset: int,
    length: int,
    slots: List[memoryview],
    deliver: Callable[[int, memoryview], None],
) -> None:
    """Reads `length` bytes at `offset` through reusable slots, `len(slots)` requests in flight.

    For reads that cannot land in their destination directly (O_DIRECT into unaligned
    memory): each request fills one slot on the request pool while the calling thread hands
    the previous ones to `deliver`, in file order; a slot is reused once its delivery
    returns, so the disk keeps `len(slots) - 1` requests or more while bytes are copied out.
    One region of `read_spans_through_slots`, which says the rest.
    """
    read_spans_through_slots(fd, [(offset, length)], slots, deliver)


@dataclass
class _Counts:
    """A pipeline's requests issued, completed and delivered, in request order; `open`
    until the caller stops (no request is issued after)."""

    issued: int = 0
    done: int = 0
    delivered: int = 0
    open: bool = True


def read_spans_through_slots(
    fd: int,
    spans: Sequence[Tuple[int, int]],
    slots: List[memoryview],
    deliver: Callable[[int, memoryview], None],
    depth: Optional[int] = None,
) -> bool:
    """Reads several regions of one file as one pipeline of requests through reusable slots.

    Each region is cut into slot-sized requests, kept in flight across the regions' ends, so
    the disk does not idle between regions while the last bytes of one are copied out and
    the first request of the next is issued (per stored chunk of 16 MiB, that idle time was
    a tenth of a 4-rank load on our VM; docs/performance.md).

    With more slots than `depth`, a request is issued as soon as one in flight completes,
    into a free slot, not once the oldest was delivered: a disk that completes requests
    together then finds the next ones queued while the calling thread copies those out. With
    one slot per request in flight, 4 ranks x 1 GiB streamed into tensors left each rank's
    disk queue empty 0.02-0.03 s of a 0.43 s read; with 8 slots of 4 MiB and 6 requests in
    flight, those loads took 0.419 s against 0.442 s (`torch_dist.reader.STREAM_REQUEST`;
    docs/performance.md, sixteenth pass).

    Args:
        fd: an open file (with O_DIRECT: the offsets, lengths and slots aligned as it
            requires).
        spans: `(offset, length)` of each region, in increasing file order, not overlapping.
        slots: equal-sized buffers: a request fills one, which is reused once its delivery
            returned.
        deliver: called as `deliver(file_offset, data)` for each request, in order, in the
            calling thread; `data` is only valid during the call. A request that met the end
            of the file delivers what it read (possibly nothing) and ends the read.
        depth: requests in flight at most (default, and at most: `len(slots)`).

    Returns:
        True when every request was filled; False when the file ended first.

    Raises:
        OSError: a request failed (after every started request has finished: nothing
            writes into a slot once this returns or raises).
        Exception: whatever `deliver` raised (same guarantee).
    """
    size, nslots = len(slots[0]), len(slots)
    depth = nslots if depth is None else max(1, min(depth, nslots))
    requests = [
        (at, min(size, offset + length - at))
        for offset, length in spans
        for at in range(offset, offset + length, size)
    ]

    if nslots <= 1 or len(requests) <= 1:
        for i, (at, n) in enumerate(requests):
            got = read_upto(fd, at, slots[i % nslots][:n])
            deliver(at, slots[i % nslots][:got])
            if got < n:
                return False
        return True
    pool = request_pool()
    lock = threading.Lock()
    issued: Dict[int, Future] = {}
    count = _Counts()

    def one(i: int) -> int:
        at, n = requests[i]
        try:
            return read_upto(fd, at, slots[i % nslots][:n])
        finally:
            # counted before the request's future is done, so that the caller, once it has
            # a request's result, finds the next one issued
            with lock:
                count.done += 1
                issue()

    def issue() -> None:
        """Issues every request that has a free slot and room in flight (lock held)."""
        while (
            count.open
            and count.issued < len(requests)
            and count.issued < count.delivered + nslots  # its slot was delivered from
            and count.issued - count.done < depth
        ):
            i = count.issued
            count.issued += 1
            issued[i] = pool.submit(one, i)

    try:
        with lock:
            issue()
        for i, (at, n) in enumerate(requests):
            with lock:
                future = issued.pop(i)  # issued: every earlier request was delivered
            got = future.result()
            deliver(at, slots[i % nslots][:got])
            if got < n:
                return False  # the file ended: later requests read nothing of use
            with lock:
                count.delivered += 1
                issue()
        return True
    finally:
        with lock:
            count.open = False
            left = deque(issued.values())
        _settle(left)
