"""`AsyncRequest`, one save's background work and collective finalization, and
`AsyncCallsQueue`, which schedules requests and finalizes them once every rank is done."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Tuple

from .. import _dist
from ..errors import AsyncSaveError, CheckpointingException
from .callers import (
    AsyncCaller,
    CallState,
    CallStatus,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    _run_and_report,
    check_main_guard,
)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "call_in_sequence"]

logger = logging.getLogger(__name__)


def call_in_sequence(calls: List[Tuple[Callable[..., Any], Tuple[Any, ...]]]) -> Any:
    """Runs `(fn, args)` calls in order; returns the last one's result (module-level, so
    picklable: a prepended request still runs in a spawned worker)."""
    result = None
    for fn, args in calls:
        result = fn(*args)
    return result


def _warn_unscheduled(description: str) -> None:
    logger.warning(
        "An async checkpoint request (%s) was never scheduled nor run: nothing of it was "
        "written or committed. Pass the request save() returned to "
        "AsyncCallsQueue.schedule_async_request (then finalize it), or call its "
        "execute_sync()",
        description or "no description",
    )


@dataclass
class AsyncRequest:
    """A save whose writes run in the background and whose finalization is collective.

    Attributes:
        async_fn: run in the background with `async_fn_args` (picklable for the persistent
            caller); its return value becomes `result`.
        async_fn_args: arguments of `async_fn`.
        finalize_fns: run in order on every rank once every rank's work finished; they may
            be collective.
        preload_fn: run in the caller before scheduling (e.g. to finish host copies).
        cleanup_fns: run on this rank after finalization or failure.
        is_frozen: set when scheduled; no change afterwards.
        result: the background work's return value, set before the finalize functions run.
        description: names the request in logs and errors.
        future: work already running in this process (`from_future`); excludes `async_fn`.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], Any]]
    preload_fn: Optional[Callable[[], Any]] = None
    cleanup_fns: List[Callable[[], Any]] = field(default_factory=list)
    is_frozen: bool = False
    result: Any = None
    description: str = ""
    future: Optional[concurrent.futures.Future] = None

    def __post_init__(self) -> None:
        if self.future is not None and self.async_fn is not None:
            raise CheckpointingException(
                f"AsyncRequest {self.description!r} has both a future and an async_fn"
            )
        # a request dropped (or still held at exit) without being scheduled or run leaves
        # its directory without a commit: say so then, not never (work already running in
        # a future, e.g. a local manager's sync save, is the caller's to wait for)
        self._unscheduled: Optional[weakref.finalize] = None
        if self.future is None:
            self._unscheduled = weakref.finalize(self, _warn_unscheduled, self.description)

    def _handled(self) -> None:
        """The request is scheduled or run: no warning when it goes away."""
        pending = getattr(self, "_unscheduled", None)
        if pending is not None:
            pending.detach()
            self._unscheduled = None

    @classmethod
    def from_future(
        cls,
        future: concurrent.futures.Future,
        finalize_fns: List[Callable[[], Any]],
        *,
        cleanup_fns: Optional[List[Callable[[], Any]]] = None,
        description: str = "",
    ) -> AsyncRequest:
        """A request for work already running in this process's threads: the queue polls
        `future`; its result becomes `result`, its exception fails the call on every rank
        (the other arguments are as the attributes)."""
        cleanup = list(cleanup_fns or [])
        return cls(None, (), finalize_fns, None, cleanup, description=description, future=future)

    def _check_not_frozen(self, what: str) -> None:
        if self.is_frozen:
            raise CheckpointingException(
                f"Cannot {what} a scheduled (frozen) AsyncRequest {self.description!r}"
            )

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Appends a finalize function.

        Raises:
            CheckpointingException: if the request was already scheduled (frozen).
        """
        self._check_not_frozen("add a finalize function to")
        self.finalize_fns.append(fn)

    def prepend_async_fn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Makes the background work run `fn(*args)` (picklable) first, then the current
        `async_fn`; `result` stays the latter's return value (`fn`'s when there was none).

        Raises:
            CheckpointingException: the request is frozen, or wraps a future.
        """
        self._check_not_frozen("prepend work to")
        if self.future is not None:
            raise CheckpointingException(
                f"Cannot prepend work to AsyncRequest {self.description!r}: it wraps a future"
            )
        calls: List[Tuple[Callable[..., Any], Tuple[Any, ...]]] = [(fn, tuple(args))]
        if self.async_fn is call_in_sequence:
            calls.extend(self.async_fn_args[0])
        elif self.async_fn is not None:
            calls.append((self.async_fn, tuple(self.async_fn_args)))
        self.async_fn, self.async_fn_args = call_in_sequence, (calls,)

    def freeze(self) -> AsyncRequest:
        """Marks the request as scheduled: no more changes; returns itself."""
        self._handled()
        self.is_frozen = True
        return self

    def execute_sync(self) -> Any:
        """Runs preload, the background work and the finalize functions here; returns the
        background work's result."""
        self._handled()
        try:
            if self.preload_fn is not None:
                self.preload_fn()
            if self.future is not None:
                self.result = self.future.result()
            elif self.async_fn is not None:
                self.result = self.async_fn(*self.async_fn_args)
            for fn in self.finalize_fns:
                fn()
            return self.result
        finally:
            self.run_cleanup()

    def run_cleanup(self) -> None:
        """Runs (once) the cleanup functions."""
        fns, self.cleanup_fns = self.cleanup_fns, []
        for fn in fns:
            try:
                fn()
            except Exception:  # cleanup must not hide the primary outcome
                logger.exception("AsyncRequest cleanup failed")


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
