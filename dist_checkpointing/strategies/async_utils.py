"""Async save: requests, the processes that run them, and the queue that finalizes them.

Two phases, as in tensorstore: when `save(..., async_sharded_save=True)` returns, the data
is *copied* (the caller may change its tensors); once the request is finalized, it is
*committed* (durable, `metadata.json` written).

Protocol:
1. Every rank builds an `AsyncRequest` (the save strategy did the planning and the copy to
   host memory) and passes it to `AsyncCallsQueue.schedule_async_request`; a caller runs its
   `async_fn` in another process.
2. Every rank calls `maybe_finalize_async_calls` the same number of times. A call is
   finalized only when it has finished on every rank (a collective check); then its
   finalize functions run in order on every rank. A failure on any rank raises
   `AsyncSaveError` on every rank, the call is dropped (nothing is committed), and the
   queue keeps working.

Two callers: `TemporalAsyncCaller` forks a fresh process per request (no pickling: the child
sees the host buffers); `PersistentAsyncCaller` keeps one spawned worker fed through a
queue (no start-up cost per save; host buffers travel as shared memory).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .. import _dist
from ..errors import AsyncSaveError, CheckpointingException

__all__ = [
    "AsyncRequest",
    "AsyncCallsQueue",
    "AsyncCaller",
    "TemporalAsyncCaller",
    "PersistentAsyncCaller",
    "ThreadAsyncCaller",
]

logger = logging.getLogger(__name__)

# (state, payload): ("running", None) | ("ok", result) | ("err", message)
CallStatus = Tuple[str, Any]


@dataclass
class AsyncRequest:
    """A save whose writes run in the background and whose finalization is collective.

    Attributes:
        async_fn: run in the background process with `async_fn_args`; its return value is
            stored in `result` (it must be picklable for the persistent caller).
        async_fn_args: arguments of `async_fn`.
        finalize_fns: zero-argument callables run in order on every rank once every rank's
            `async_fn` finished; they may be collective.
        preload_fn: run in the caller before scheduling (e.g. to finish host copies).
        cleanup_fns: run after finalization or failure, on this rank (e.g. to return host
            buffers to their pool).
        result: `async_fn`'s return value, set before the finalize functions run.
        run_in_thread: run `async_fn` in a thread of the calling process instead of another
            process (for work already running in the caller's own background threads, such
            as local checkpoint exchanges, whose `async_fn` only waits for it).
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], Any]]
    preload_fn: Optional[Callable[[], Any]] = None
    cleanup_fns: List[Callable[[], Any]] = field(default_factory=list)
    is_frozen: bool = False
    result: Any = None
    description: str = ""
    run_in_thread: bool = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Appends a finalize function.

        Raises:
            CheckpointingException: if the request was already scheduled (frozen).
        """
        if self.is_frozen:
            raise CheckpointingException(
                "Cannot add a finalize function to a scheduled (frozen) AsyncRequest"
            )
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """Marks the request as scheduled: no more finalize functions; returns itself."""
        self.is_frozen = True
        return self

    def execute_sync(self) -> Any:
        """Runs preload, the async function and the finalize functions in the caller.

        Returns:
            The async function's result.
        """
        try:
            if self.preload_fn is not None:
                self.preload_fn()
            if self.async_fn is not None:
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


def call_in_sequence(calls: List[Tuple[Callable[..., Any], Tuple[Any, ...]]]) -> Any:
    """Runs `(fn, args)` calls in order; returns the last one's result (an async_fn helper)."""
    result = None
    for fn, args in calls:
        result = fn(*args)
    return result


def _run_and_report(fn: Callable[..., Any], args: Tuple[Any, ...]) -> CallStatus:
    try:
        return ("ok", fn(*args))
    except BaseException as e:  # reported to the parent, raised there on every rank
        return ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")


class AsyncCaller(ABC):
    """Runs one request's `async_fn` away from the training loop."""

    @abstractmethod
    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        """Starts running `request.async_fn` (does not wait)."""

    @abstractmethod
    def poll(self, call_idx: int, block: bool) -> CallStatus:
        """Returns the call's status; with `block`, waits until it is not running."""

    @abstractmethod
    def close(self) -> None:
        """Releases the caller's processes (waits for running calls)."""


def _lower_priority(niceness: int) -> None:
    """Makes this (writer) process yield the CPU to the training processes."""
    if niceness > 0:
        try:
            os.nice(niceness)
        except OSError as e:
            logger.debug("could not lower writer priority: %s", e)


def _temporal_child(
    fn: Callable[..., Any], args: Tuple[Any, ...], conn: Any, niceness: int
) -> None:
    _lower_priority(niceness)
    conn.send(_run_and_report(fn, args))
    conn.close()


class TemporalAsyncCaller(AsyncCaller):
    """A fresh forked process per request; it inherits the host buffers without copying.

    Args:
        niceness: added to the writer's nice value so training keeps the CPU.
    """

    def __init__(self, niceness: int = 0) -> None:
        self._calls: Dict[int, Tuple[Any, Any]] = {}
        self.niceness = niceness

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_temporal_child,
            args=(request.async_fn, request.async_fn_args, send, self.niceness),
            daemon=True,
            name=f"dc-async-{call_idx}",
        )
        proc.start()
        send.close()  # so that the child's death shows as EOF here
        self._calls[call_idx] = (proc, recv)

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        proc, recv = self._calls[call_idx]
        if not block and not recv.poll(0):
            if proc.is_alive():
                return ("running", None)
            proc.join()
            if not recv.poll(0):
                return self._finish(
                    call_idx,
                    (
                        "err",
                        f"background writer (pid {proc.pid}) died with exit code {proc.exitcode}",
                    ),
                )
        try:
            status: CallStatus = recv.recv()
        except EOFError:
            proc.join()
            status = (
                "err",
                f"background writer (pid {proc.pid}) died with exit code {proc.exitcode}",
            )
        return self._finish(call_idx, status)

    def _finish(self, call_idx: int, status: CallStatus) -> CallStatus:
        proc, recv = self._calls.pop(call_idx)
        recv.close()
        proc.join(timeout=30)
        return status

    def close(self) -> None:
        for proc, recv in self._calls.values():
            proc.join(timeout=60)
            recv.close()
        self._calls.clear()


class ThreadAsyncCaller(AsyncCaller):
    """Runs each request's `async_fn` in a daemon thread of the calling process."""

    def __init__(self) -> None:
        self._calls: Dict[int, Tuple[threading.Thread, List[CallStatus]]] = {}

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        box: List[CallStatus] = []
        fn, args = request.async_fn, request.async_fn_args
        assert fn is not None
        thread = threading.Thread(
            target=lambda: box.append(_run_and_report(fn, args)),
            name=f"dc-async-{call_idx}",
            daemon=True,
        )
        thread.start()
        self._calls[call_idx] = (thread, box)

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        thread, box = self._calls[call_idx]
        if block:
            thread.join()
        if thread.is_alive():
            return ("running", None)
        del self._calls[call_idx]
        return box[0] if box else ("err", "background thread ended without a result")

    def close(self) -> None:
        for thread, _ in self._calls.values():
            thread.join(timeout=60)
        self._calls.clear()


def _persistent_worker(tasks: Any, results: Any, niceness: int) -> None:
    _lower_priority(niceness)
    while True:
        task = tasks.get()
        if task is None:
            return
        call_idx, fn, args = task
        status = _run_and_report(fn, args)
        del fn, args, task  # drop shared-memory handles before the next request
        results.put((call_idx, status))


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived spawned worker process, fed through a queue; restarted if it dies.

    Args:
        niceness: added to the worker's nice value so training keeps the CPU.
    """

    def __init__(self, niceness: int = 0) -> None:
        import torch.multiprocessing as tmp

        self.niceness = niceness
        self._ctx = tmp.get_context("spawn")
        self._proc: Any = None
        self._tasks: Any = None
        self._results: Any = None
        self._pending: List[int] = []
        self._done: Dict[int, CallStatus] = {}

    def _ensure_worker(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(
            target=_persistent_worker,
            args=(self._tasks, self._results, self.niceness),
            daemon=True,
            name="dc-async-worker",
        )
        self._proc.start()
        logger.debug("started persistent async worker pid %d", self._proc.pid)

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        self._ensure_worker()
        self._tasks.put((call_idx, request.async_fn, request.async_fn_args))
        self._pending.append(call_idx)

    def _drain(self, timeout: Optional[float]) -> None:
        try:
            call_idx, status = (
                self._results.get(timeout=timeout) if timeout else self._results.get_nowait()
            )
        except Exception:  # queue.Empty
            return
        self._done[call_idx] = status
        self._pending.remove(call_idx)

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        while call_idx not in self._done:
            self._drain(0.2 if block else None)
            if call_idx in self._done:
                break
            if not self._proc.is_alive():
                self._drain(None)  # a result may have arrived just before the exit
                if call_idx in self._done:
                    break
                code = self._proc.exitcode
                for idx in self._pending:
                    self._done[idx] = (
                        "err",
                        f"persistent async worker (pid {self._proc.pid}) died with exit code {code}",
                    )
                self._pending.clear()
                break
            if not block:
                return ("running", None)
        return self._done.pop(call_idx)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._tasks.put(None)
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = None


@dataclass
class _Call:
    idx: int
    request: AsyncRequest
    caller: AsyncCaller
    scheduled_at: float


_live_queues: weakref.WeakSet[AsyncCallsQueue] = weakref.WeakSet()
_atexit_registered = False


def _warn_unfinalized_at_exit() -> None:
    for q in list(_live_queues):
        n = q.get_num_unfinalized_calls()
        if n:
            logger.warning(
                "Process exiting with %d unfinalized async checkpoint save(s): their checkpoints are not "
                "committed (no metadata.json). Call AsyncCallsQueue.close() (or "
                "maybe_finalize_async_calls(blocking=True)) on every rank before exiting.",
                n,
            )
        q._shutdown_callers()


class AsyncCallsQueue:
    """Schedules async requests and finalizes them, in order, once all ranks are done.

    Args:
        persistent: use one persistent worker process (True) or a fresh forked process per
            request (False).
        writer_niceness: how much lower than the training process the writers run (Unix
            nice increment; 0 keeps the same priority). Writes mostly wait on the disk, so a
            low priority costs them little and keeps the CPU for training.
    """

    def __init__(self, persistent: bool = False, *, writer_niceness: int = 19) -> None:
        global _atexit_registered
        self.persistent = persistent
        self.writer_niceness = writer_niceness
        self._calls: Deque[_Call] = deque()
        self._next_idx = 0
        self._persistent_caller: Optional[PersistentAsyncCaller] = None
        self._temporal_caller: Optional[TemporalAsyncCaller] = None
        self._thread_caller: Optional[ThreadAsyncCaller] = None
        _live_queues.add(self)
        if not _atexit_registered:
            atexit.register(_warn_unfinalized_at_exit)
            _atexit_registered = True

    def _caller(self, request: AsyncRequest) -> AsyncCaller:
        if request.run_in_thread:
            if self._thread_caller is None:
                self._thread_caller = ThreadAsyncCaller()
            return self._thread_caller
        if self.persistent:
            if self._persistent_caller is None:
                self._persistent_caller = PersistentAsyncCaller(self.writer_niceness)
            return self._persistent_caller
        if self._temporal_caller is None:
            self._temporal_caller = TemporalAsyncCaller(self.writer_niceness)
        return self._temporal_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts a request's background work; returns its call index.

        Raises:
            CheckpointingException: if the preload function fails.
        """
        request = async_request.freeze()
        if request.preload_fn is not None:
            request.preload_fn()
        idx = self._next_idx
        self._next_idx += 1
        if request.async_fn is None:
            self._calls.append(_Call(idx, request, _NoopCaller(), time.perf_counter()))
            return idx
        caller = self._caller(request)
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
            state, payload = call.caller.poll(call.idx, blocking)
            if no_dist:
                any_running, any_failed = state == "running", state == "err"
            else:  # one small all-reduce per poll; messages are exchanged only on failure
                any_running, any_failed = (
                    bool(v) for v in _dist.all_reduce_max([state == "running", state == "err"])
                )
            if any_running:
                if state != "running":  # keep our finished status for the next poll
                    call.caller = _DoneCaller(state, payload)
                break
            self._calls.popleft()
            if any_failed:
                call.request.run_cleanup()
                mine = str(payload).strip().splitlines()[0] if state == "err" and payload else None
                reports = [mine] if no_dist else _dist.all_gather_object(mine)
                failed = [(r, m) for r, m in enumerate(reports) if m is not None]
                detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
                if state == "err":
                    logger.error("async save call %d failed on this rank:\n%s", call.idx, payload)
                raise AsyncSaveError(
                    f"Async save call {call.idx} ({call.request.description}) failed on rank(s) "
                    f"{', '.join(str(r) for r, _ in failed)}: {detail}"
                )
            call.request.result = payload
            try:
                for fn in call.request.finalize_fns:
                    fn()
            finally:
                call.request.run_cleanup()
            logger.info(
                "async save call %d (%s) finalized %.2f s after scheduling",
                call.idx,
                call.request.description,
                time.perf_counter() - call.scheduled_at,
            )
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
        for caller in (self._persistent_caller, self._temporal_caller, self._thread_caller):
            if caller is not None:
                caller.close()
        self._persistent_caller = None
        self._temporal_caller = None
        self._thread_caller = None


class _NoopCaller(AsyncCaller):
    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        pass

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        return ("ok", None)

    def close(self) -> None:
        pass


class _DoneCaller(AsyncCaller):
    """Holds a status that was polled once already (callers report each result only once)."""

    def __init__(self, state: str, payload: Any) -> None:
        self._status: CallStatus = (state, payload)

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        raise AssertionError("not schedulable")

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        return self._status

    def close(self) -> None:
        pass
