"""Every storage test starts and ends with no read or write probe kept and no directory
marked as refusing O_DIRECT: both are process-wide caches that one test would otherwise
leave to the next. Tests of the node's records take `record_dir`."""

from __future__ import annotations

import pytest

from dist_checkpointing.storage import direct, probe, records, write_probe


def _forget() -> None:
    probe.forget_probes()
    write_probe.forget_write_probes()
    direct.reset_direct_fallbacks()


@pytest.fixture(autouse=True)
def _fresh_io_state():
    _forget()
    yield
    _forget()


@pytest.fixture
def record_dir(tmp_path, monkeypatch):
    """The node's records (`storage.records`) kept in a directory of the test's own."""
    where = tmp_path / "records"
    monkeypatch.setenv(records.ENV, str(where))
    return where
