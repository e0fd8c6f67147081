import logging
from pathlib import Path

import pytest

from tests._world import close_all_worlds, get_world

#: the folders whose test modules probe side interpreters as they are collected
_PROBING = ("interop", "examples", "tools")


def pytest_collection(session: pytest.Session) -> None:
    """When the session collects tests that probe side interpreters (megatron-core, torchao,
    lm-resiliency), every probe starts now, at once, beside the collection."""
    here = Path(__file__).resolve().parent
    wanted = [here / name for name in _PROBING]
    for arg in session.config.args:
        path = Path(arg.split("::")[0]).resolve()
        if any(path == w or path in w.parents or w in path.parents for w in wanted):
            from tests.interop import _launch

            _launch.probe_all_in_background()
            return


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worlds():
    yield
    close_all_worlds()


@pytest.fixture(scope="session")
def mcore016_jobs(tmp_path_factory):
    """megatron-core 0.16.1's save, load of ours and float8 pair, one side run per session
    (`tests/interop/_side_jobs.py`; skips when megatron-core is not installed)."""
    from tests.interop import _side_jobs

    return _side_jobs.mcore016(tmp_path_factory.mktemp("mcore016"))


@pytest.fixture(scope="session")
def mcore019_jobs(tmp_path_factory):
    """megatron-core 0.19.2's save and load of ours, one side run per session
    (`tests/interop/_side_jobs.py`; skips when it is not set up)."""
    from tests.interop import _side_jobs

    return _side_jobs.mcore019(tmp_path_factory.mktemp("mcore019"))


@pytest.fixture
def world_factory():
    """Returns get_world(n): a reusable gloo world of n ranks."""
    return get_world


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING)
    yield
