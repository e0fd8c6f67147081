"""Property: random tensors, dtypes and shardings (empty shards and flat shards included)
round-trip bitwise through save/load with another layout.

Examples are drawn in the test process and run as one batch inside a reused world, since
spawning a world per example would be far too slow.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._sharding import Case, cases
from tests.distributed._rank_fns import check_load_cases, roundtrip_cases, save_cases

SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


def _batch(world: int, load_world: int = 0) -> st.SearchStrategy:
    def rename(cs: list) -> list:
        return [Case(**{**c.__dict__, "key": f"t{i}.weight"}) for i, c in enumerate(cs)]

    return st.lists(cases(world, load_world=load_world), min_size=6, max_size=10).map(rename)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.timeout(300)
def test_random_shardings_round_trip_bitwise_when_resharded(
    world_size, world_factory, tmp_path_factory
):
    world = world_factory(world_size)

    @SETTINGS
    @given(_batch(world_size))
    def run(batch):
        root = tmp_path_factory.mktemp("rt")
        problems = world.run_ok(roundtrip_cases, batch, str(root), timeout=120)
        assert problems == [[]] * world_size, problems

    run()


@pytest.mark.parametrize("save_world,load_world", [(4, 2), (2, 4), (4, 1), (1, 2)])
@pytest.mark.timeout(300)
def test_random_shardings_round_trip_bitwise_when_world_size_changes(
    save_world, load_world, world_factory, tmp_path_factory
):
    @SETTINGS
    @given(_batch(save_world, load_world))
    def run(batch):
        root = tmp_path_factory.mktemp("rtw")
        world_factory(save_world).run_ok(save_cases, batch, str(root), timeout=120)
        problems = world_factory(load_world).run_ok(check_load_cases, batch, str(root), timeout=120)
        assert problems == [[]] * load_world, problems

    run()
