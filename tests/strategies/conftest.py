"""Every storage test starts and ends with no read or write probe kept and no directory
marked as refusing O_DIRECT: both are process-wide caches that one test would otherwise
leave to the next."""

from __future__ import annotations

import pytest

from dist_checkpointing.storage import direct, probe, write_probe


def _forget() -> None:
    probe.forget_probes()
    write_probe.forget_write_probes()
    direct.reset_direct_fallbacks()


@pytest.fixture(autouse=True)
def _fresh_io_state():
    _forget()
    yield
    _forget()
