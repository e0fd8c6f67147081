"""megatron-core's import path of the async save service (`dist_checkpointing.async_save`)."""

from __future__ import annotations

from .. import async_save as _async_save
from ..async_save import *  # noqa: F403  (the names of async_save.__all__)

__all__ = list(_async_save.__all__)
