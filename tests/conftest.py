import logging
import os

import pytest

from tests._world import close_all_worlds, get_world

# The node's records of measured I/O paths (`dist_checkpointing.storage.records`) would carry
# one test's measurement into the next (and into the developer's own cache directory):
# they are off for every test process; the tests of records point it at a directory of
# their own.
os.environ["DIST_CKPT_CACHE_DIR"] = ""


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worlds():
    yield
    close_all_worlds()


@pytest.fixture
def world_factory():
    """Returns get_world(n): a reusable gloo world of n ranks."""
    return get_world


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING)
    yield
