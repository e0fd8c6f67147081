import logging

import pytest

from tests._world import close_all_worlds, get_world


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
