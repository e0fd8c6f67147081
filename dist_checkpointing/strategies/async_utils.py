"""Async save service, re-exported at its reference path (see `dist_checkpointing.async_save`)."""

from __future__ import annotations

from ..async_save import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    CallState,
    CallStatus,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    call_in_sequence,
)

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
