"""`AsyncRequest`: one save's background work and its collective finalization.

A request carries either a function to run away from the training loop (`async_fn`, run
by a caller in another process) or a future for work that already runs in the caller's
own background threads (`from_future`). Producers (save strategies, `serialization`, the
local checkpoint manager) build requests; `AsyncCallsQueue` runs and finalizes them.
Requests are changed only through their methods, and only until they are scheduled.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from ..errors import CheckpointingException

__all__ = ["AsyncRequest", "CallState", "CallStatus", "call_in_sequence"]

logger = logging.getLogger(__name__)


class CallState(enum.Enum):
    """Where a scheduled call stands on one rank."""

    RUNNING = "running"
    """The background work has not finished."""
    OK = "ok"
    """It finished; the payload is `async_fn`'s return value."""
    FAILED = "failed"
    """It raised, crashed or was killed; the payload is a message."""


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


@dataclass
class AsyncRequest:
    """A save whose writes run in the background and whose finalization is collective.

    Attributes:
        async_fn: run in the background process with `async_fn_args`; its return value is
            stored in `result` (it must be picklable for the persistent caller).
        async_fn_args: arguments of `async_fn`.
        finalize_fns: zero-argument callables run in order on every rank once every rank's
            background work finished; they may be collective.
        preload_fn: run in the caller before scheduling (e.g. to finish host copies).
        cleanup_fns: run after finalization or failure, on this rank (e.g. to return host
            buffers to their pool).
        is_frozen: set when the request is scheduled; it cannot change afterwards.
        result: the background work's return value, set before the finalize functions run.
        description: names the request in logs and errors.
        future: background work already running in this process (see `from_future`);
            mutually exclusive with `async_fn`.
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
        """A request for work already running in this process's own background threads.

        The queue polls `future` instead of starting a process; its result becomes the
        request's `result`, and its exception fails the call on every rank.

        Args:
            future: the running work.
            finalize_fns: as the attribute.
            cleanup_fns: as the attribute.
            description: as the attribute.

        Returns:
            The request (not scheduled).
        """
        return cls(
            None,
            (),
            finalize_fns,
            cleanup_fns=list(cleanup_fns or []),
            description=description,
            future=future,
        )

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
        """Makes the background work run `fn(*args)` first, then the current `async_fn`.

        The request's `result` stays the current `async_fn`'s return value (or `fn`'s when
        there was none). `fn` and `args` must be picklable for the persistent caller.

        Args:
            fn: the work to run first, in the same background process.
            *args: its arguments.

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

    def run_background_work(self) -> Any:
        """Runs (or waits for) the background work in the caller; returns its result.

        Raises:
            Exception: whatever the work raised.
        """
        if self.future is not None:
            return self.future.result()
        if self.async_fn is not None:
            return self.async_fn(*self.async_fn_args)
        return None

    def execute_sync(self) -> Any:
        """Runs preload, the background work and the finalize functions in the caller.

        Returns:
            The background work's result.
        """
        try:
            if self.preload_fn is not None:
                self.preload_fn()
            self.result = self.run_background_work()
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
