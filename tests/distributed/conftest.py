"""Fixtures of the 2-rank failure tests (`test_failures.py`, `test_megatron_phrases.py`)."""

from __future__ import annotations

import pytest

from tests.distributed._failure_fns import WORLD, good_state
from tests.distributed._rank_fns import call_save


@pytest.fixture
def world(world_factory):
    """A world of 2 gloo ranks."""
    return world_factory(WORLD)


@pytest.fixture
def saved(world, tmp_path):
    """A checkpoint of `good_state` saved by `world`; returns its directory."""
    ckpt = str(tmp_path / "ckpt")
    world.run_ok(call_save, good_state, ckpt)
    return ckpt
