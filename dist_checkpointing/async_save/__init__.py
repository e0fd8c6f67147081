"""Async save: requests and the queue that finalizes them (`queue`), and the processes that
run them (`callers`). When `save(..., async_sharded_save=True)` returns, the data is
*copied*; once the request is finalized, it is *committed* (durable). Depends only on the
core, so both `strategies/` and `local/` use it.
"""

from __future__ import annotations

from .callers import AsyncCaller, CallState, CallStatus, PersistentAsyncCaller, TemporalAsyncCaller
from .queue import AsyncCallsQueue, AsyncRequest, call_in_sequence

__all__ = [
    "AsyncRequest",
    "AsyncCallsQueue",
    "AsyncCaller",
    "TemporalAsyncCaller",
    "PersistentAsyncCaller",
    "CallState",
    "CallStatus",
    "call_in_sequence",
]
