"""`AsyncRequest`: one save's background work (in another process, or a future in this
one's threads) and its collective finalization; it changes only until it is scheduled."""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from ..errors import CheckpointingException

__all__ = ["AsyncRequest", "CallState", "CallStatus", "call_in_sequence"]

logger = logging.getLogger(__name__)


class CallState(enum.Enum):
    """Where a scheduled call stands on one rank: still RUNNING, finished OK (payload: the
    result), or FAILED (raised, crashed or killed; payload: a message)."""

    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"


#: (state, payload): the payload is the result (OK), a message (FAILED) or None (RUNNING)
CallStatus = Tuple[CallState, Any]


def call_in_sequence(calls: List[Tuple[Callable[..., Any], Tuple[Any, ...]]]) -> Any:
    """Runs `(fn, args)` calls in order; returns the last one's result.

    Module-level (picklable), so a prepended request still runs in a spawned worker.
    """
    result = None
    for fn, args in calls:
        result = fn(*args)
    return result


def _run_and_report(fn: Callable[..., Any], args: Tuple[Any, ...]) -> CallStatus:
    """Runs `fn(*args)`; a failure becomes a FAILED status (reported on every rank)."""
    try:
        return (CallState.OK, fn(*args))
    except BaseException as e:  # reported to every rank by the queue
        return (CallState.FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")


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
        self.is_frozen = True
        return self

    def execute_sync(self) -> Any:
        """Runs preload, the background work and the finalize functions here; returns the
        background work's result."""
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
