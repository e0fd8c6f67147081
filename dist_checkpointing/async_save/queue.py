"""`AsyncCallsQueue`: schedules async requests and finalizes them once every rank is done."""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional

from .. import _dist
from ..errors import AsyncSaveError
from .callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller, check_main_guard
from .request import AsyncRequest, CallState, CallStatus, _run_and_report

__all__ = ["AsyncCallsQueue"]

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    """A scheduled request and how to learn its state on this rank."""

    idx: int
    request: AsyncRequest
    caller: Optional[AsyncCaller]  # None: the request wraps a future, or has no work
    scheduled_at: float
    #: this rank's final status once known (callers report each outcome only once)
    status: Optional[CallStatus] = None

    def poll(self, block: bool) -> CallStatus:
        """This rank's status of the call; with `block`, waits until it is not running."""
        if self.status is not None:
            return self.status
        future = self.request.future
        if self.caller is not None:
            status = self.caller.poll(self.idx, block)
        elif future is None:
            status = (CallState.OK, None)
        elif not block and not future.done():
            return (CallState.RUNNING, None)
        else:
            status = _run_and_report(future.result, ())  # waits for it
        if status[0] is not CallState.RUNNING:
            self.status = status
        return status


_live_queues: weakref.WeakSet[AsyncCallsQueue] = weakref.WeakSet()
_atexit_registered = False


def _warn_unfinalized_at_exit() -> None:
    for q in list(_live_queues):
        n = q.get_num_unfinalized_calls()
        if n:
            msg = "Process exiting with %d unfinalized async checkpoint save(s): they are not "
            msg += "committed and will not be loaded. Call AsyncCallsQueue.close() (or "
            msg += "maybe_finalize_async_calls(blocking=True)) on every rank before exiting."
            logger.warning(msg, n)
        q._shutdown_callers()


class AsyncCallsQueue:
    """Schedules async requests and finalizes them, in order, once all ranks are done.

    Args:
        persistent: use one persistent worker process (True) or a fresh forked process per
            request (False).
        writer_niceness: Unix nice increment of the writers (0: the same priority). Writes
            mostly wait on the disk, so a low priority keeps the CPU for training cheaply.
    """

    def __init__(self, persistent: bool = False, *, writer_niceness: int = 19) -> None:
        global _atexit_registered
        self.persistent = persistent
        self.writer_niceness = writer_niceness
        self._calls: Deque[_Call] = deque()
        self._next_idx = 0
        self._caller: Optional[AsyncCaller] = None  # made on the first request with work
        _live_queues.add(self)
        if not _atexit_registered:
            atexit.register(_warn_unfinalized_at_exit)
            _atexit_registered = True

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts a request's background work; returns its call index.

        Raises:
            CheckpointingException: if the preload function fails, or (persistent writer)
                the main script calls this outside `if __name__ == "__main__":`, which the
                spawned writer would re-run.
        """
        if self.persistent and self._caller is None:
            check_main_guard()  # before any work: the spawned writer would re-run the script
        request = async_request.freeze()
        if request.preload_fn is not None:
            request.preload_fn()
        idx = self._next_idx
        self._next_idx += 1
        caller: Optional[AsyncCaller] = None
        if request.async_fn is not None:
            if self._caller is None:
                kind = PersistentAsyncCaller if self.persistent else TemporalAsyncCaller
                self._caller = kind(self.writer_niceness)
            caller = self._caller
            caller.schedule(idx, request)
        self._calls.append(_Call(idx, request, caller, time.perf_counter()))
        return idx

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> List[int]:
        """Finalizes, in order, the calls that finished on every rank.

        Collective unless `no_dist`: every rank must call it the same number of times.

        Args:
            blocking: wait for every scheduled call to finish, then finalize them all.
            no_dist: decide from this rank alone (no collective), for single-rank use.

        Returns:
            The indices of the calls finalized by this invocation.

        Raises:
            AsyncSaveError: on every rank, if a call failed on any rank (that call is
                dropped, nothing of it is committed; later calls stay queued).
        """
        finalized: List[int] = []
        while self._calls:
            call = self._calls[0]
            state, payload = call.poll(blocking)
            failed_here = state is CallState.FAILED
            flags = [int(state is CallState.RUNNING), int(failed_here)]
            # one small all-reduce per poll; messages are exchanged only on failure
            any_running, any_failed = flags if no_dist else _dist.all_reduce_max(flags)
            if any_running:
                break
            self._calls.popleft()
            if any_failed:
                call.request.run_cleanup()
                mine = str(payload).strip().splitlines()[0] if failed_here and payload else None
                reports = [mine] if no_dist else _dist.all_gather_object(mine)
                failed = [(r, m) for r, m in enumerate(reports) if m is not None]
                if failed_here:
                    logger.error("async save call %d failed on this rank:\n%s", call.idx, payload)
                raise AsyncSaveError(
                    _dist.format_rank_failures(
                        f"Async save call {call.idx} ({call.request.description})", failed
                    )
                )
            call.request.result = payload
            try:
                for fn in call.request.finalize_fns:
                    fn()
            finally:
                call.request.run_cleanup()
            took = time.perf_counter() - call.scheduled_at
            msg = "async save call %d (%s) finalized %.2f s after scheduling"
            logger.info(msg, call.idx, call.request.description, took)
            finalized.append(call.idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet."""
        return len(self._calls)

    def close(self) -> None:
        """Collective: waits for and finalizes every call, then stops the worker processes."""
        try:
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._shutdown_callers()

    def _shutdown_callers(self) -> None:
        if self._caller is not None:
            self._caller.close()
        self._caller = None
