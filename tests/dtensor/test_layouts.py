"""Property: any saved DTensor layout (1-D and 2-D meshes; Shard, Replicate and FSDP2's
strided sharding; uneven and empty shards) or megatron-style ShardedTensor layout of a
global tensor loads bit for bit into any requested DTensor or ShardedTensor layout of it,
on a 4-rank gloo world; and the layout function agrees with DTensor's own chunk list."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dtensor import _layouts

pytestmark = pytest.mark.timeout(300)
WORLD = 4


@st.composite
def _layout(draw: Any, ndim: int) -> tuple:
    kind = draw(st.sampled_from(["1d", "2d", "strided", "rows"]))
    if kind == "rows":
        return ("rows",)
    if kind == "strided":  # FSDP2 over tensor parallelism on a (2, 2) mesh
        d = draw(st.integers(0, ndim - 1))
        return ("dtensor", (2, 2), (("SS", d, 2), ("S", d)))
    mesh = (4,) if kind == "1d" else draw(st.sampled_from([(2, 2), (1, 4), (4, 1)]))
    place = st.one_of(st.just(("R",)), st.tuples(st.just("S"), st.integers(0, ndim - 1)))
    return ("dtensor", mesh, tuple(draw(place) for _ in mesh))


@st.composite
def _case(draw: Any) -> tuple:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=2)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return shape, dtype, draw(_layout(len(shape))), draw(_layout(len(shape)))


def test_any_saved_layout_loads_bitwise_into_any_requested_layout(world_factory, tmp_path_factory):
    world = world_factory(WORLD)

    @settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(_case(), min_size=10, max_size=10))
    def run(batch):
        root = str(tmp_path_factory.mktemp("layouts"))
        results = world.run_ok(_layouts.run_cases, batch, root, timeout=200)
        for case, *got in zip(batch, *results):
            assert got == ["same"] * WORLD, (case, got)

    run()


def test_meshes_holding_ranks_in_another_order_save_and_load_by_mesh_coordinate(
    world_factory, tmp_path
):
    """A rank's piece is where its mesh coordinate puts it, not its rank: meshes that hold
    the ranks in reverse order, saved and loaded across each other and row blocks."""
    rev_1d = ("dtensor", (4,), (("S", 0),), "reversed")
    rev_2d = ("dtensor", (2, 2), (("S", 0), ("S", 1)), "reversed")
    cases = [
        ((7, 5), torch.float32, rev_1d, ("rows",)),
        ((7, 5), torch.float32, ("rows",), rev_1d),
        ((7, 5), torch.float32, ("dtensor", (4,), (("S", 0),)), rev_1d),
        ((7, 5), torch.float32, rev_2d, ("dtensor", (4,), (("S", 1),))),
        ((7, 5), torch.float32, rev_2d, rev_2d),
        ((6, 3), torch.int64, ("dtensor", (2, 2), (("R",), ("S", 0)), "reversed"), ("rows",)),
    ]
    results = world_factory(WORLD).run_ok(_layouts.run_cases, cases, str(tmp_path), timeout=200)
    for case, *got in zip(cases, *results):
        assert got == ["same"] * WORLD, (case, got)
