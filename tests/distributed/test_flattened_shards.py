"""Flat shards (megatron-core <= 0.13's distributed optimizer) on 1, 2 and 4 gloo ranks.

Saved flat, they load with any other layout, flat (other ranges, other grid, other world
size) or not; saved unflattened, they load flat; `load_tensors_metadata` of a flat checkpoint
equals the unflattened one's; overlapping flat ranges raise on every rank.
"""

from __future__ import annotations

import pytest

from dist_checkpointing.errors import ShardingIntegrityError
from tests.distributed._behaviour_fns import (
    load_flat_layout,
    load_pieces,
    overlapping_flat_state,
    save_flat_layout,
    save_pieces,
    tensors_metadata,
)
from tests.distributed._rank_fns import call_save

pytestmark = pytest.mark.timeout(300)
SHAPE = (8, 12)


def _rows(world: int):
    rows = SHAPE[0] // world
    return [[((r * rows, 0), (rows, SHAPE[1]))] for r in range(world)]


# (save world, grid axis, flat cuts) -> (load world, grid axis, flat cuts)
CASES = [
    ((4, 0, [5, 13]), (2, 1, [7, 30])),
    ((2, 1, [17, 40]), (4, 0, [3, 4, 20])),
    ((1, 0, [50]), (4, 1, [1, 23])),
    ((4, 1, [0, 24]), (1, 0, [95])),
]


@pytest.mark.parametrize("save,load", CASES)
def test_flat_shards_round_trip_with_another_flat_layout(save, load, world_factory, tmp_path):
    root = str(tmp_path / "flat")
    sw, saxis, scuts = save
    lw, laxis, lcuts = load
    world_factory(sw).run_ok(save_flat_layout, root, "opt.w", SHAPE, saxis, scuts, timeout=150)
    problems = world_factory(lw).run_ok(
        load_flat_layout, root, "opt.w", SHAPE, laxis, lcuts, timeout=150
    )
    assert problems == [[]] * lw
    # the same checkpoint loads unflattened, in row blocks
    assert (
        world_factory(lw).run_ok(load_pieces, root, "opt.w", SHAPE, _rows(lw), timeout=150)
        == [[]] * lw
    )


@pytest.mark.parametrize("save_world,load_world", [(2, 4), (4, 1)])
def test_unflattened_checkpoint_loads_flat_and_metadata_matches(
    save_world, load_world, world_factory, tmp_path
):
    plain, flat = str(tmp_path / "plain"), str(tmp_path / "flat")
    world_factory(save_world).run_ok(save_pieces, plain, "opt.w", SHAPE, _rows(save_world))
    world_factory(save_world).run_ok(save_flat_layout, flat, "opt.w", SHAPE, 0, [9, 10])
    assert (
        world_factory(load_world).run_ok(
            load_flat_layout, plain, "opt.w", SHAPE, 1, [11, 25], timeout=150
        )
        == [[]] * load_world
    )
    meta = world_factory(load_world).run_ok(tensors_metadata, flat)
    assert meta == world_factory(load_world).run_ok(tensors_metadata, plain)
    assert "global=(8, 12)" in meta[0]["opt.w"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlapping_flat_ranges_raise_on_every_rank(world_size, world_factory, tmp_path):
    outcomes = world_factory(world_size).run(call_save, overlapping_flat_state, str(tmp_path / "c"))
    for o in outcomes:
        assert isinstance(o.error, ShardingIntegrityError), o.trace
        assert "Invalid access pattern for 'f'" in str(o.error) and "overlap" in str(o.error)
