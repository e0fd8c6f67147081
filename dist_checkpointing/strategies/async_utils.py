"""Async save service, re-exported at its reference path (see `dist_checkpointing.async_save`).

megatron-core's code imports `AsyncRequest` and `AsyncCallsQueue` from here; the names are
defined in `dist_checkpointing.async_save`, whose `__all__` is the one list of them.
"""

from __future__ import annotations

from .. import async_save as _async_save
from ..async_save import *  # noqa: F403  (the names of async_save.__all__)

__all__ = list(_async_save.__all__)
