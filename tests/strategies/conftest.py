"""Every storage test starts and ends with no directory marked as refusing O_DIRECT: the
registry is process-wide, and one test would otherwise leave it to the next."""

from __future__ import annotations

import pytest

from dist_checkpointing.storage import reset_direct_fallbacks


@pytest.fixture(autouse=True)
def _fresh_io_state():
    reset_direct_fallbacks()
    yield
    reset_direct_fallbacks()
