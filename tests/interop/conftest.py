"""The interop tests' long side runs start in the background as the first interop test does."""

from __future__ import annotations

import pytest

from tests.interop import _side_jobs


@pytest.fixture(scope="session", autouse=True)
def _long_side_runs_in_background(request, tmp_path_factory):
    """Starts, at most two at a time and in the order the tests need them, the long side runs
    of `test_hf_model.py`, `test_huggingface.py` (its first step), `test_megatron_core013.py`
    and `test_megatron_model.py` that the selected tests need; their fixtures wait for them
    (`_side_jobs.in_background`). Runs not started by the end of the session are dropped."""
    from tests.interop import (
        test_hf_model,
        test_huggingface,
        test_megatron_core013,
        test_megatron_model,
    )

    for module in (test_hf_model, test_huggingface, test_megatron_core013, test_megatron_model):
        fixtures = {
            name
            for item in request.session.items
            if getattr(item, "module", None) is module
            for name in getattr(item, "fixturenames", ())
        }
        module.start_in_background(tmp_path_factory, fixtures)
    yield
    _side_jobs.stop_background()
