"""Async save: requests, the processes that run them, and the queue that finalizes them.

Two phases, as in tensorstore: when `save(..., async_sharded_save=True)` returns, the data
is *copied* (the caller may change its tensors); once the request is finalized, it is
*committed* (durable, `metadata.json` written).

Modules: `request` (`AsyncRequest`, the call states), `callers` (the processes that run a
request's `async_fn`), `queue` (`AsyncCallsQueue`: scheduling and collective finalization).
This package depends only on the core (`_dist`, `errors`), so both `strategies/` and
`local/` use it.
"""

from __future__ import annotations

from .callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller
from .queue import AsyncCallsQueue
from .request import AsyncRequest, CallState, CallStatus, call_in_sequence

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
