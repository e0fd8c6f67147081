"""Zero-size shards and `allow_shape_mismatch`, as megatron-core users rely on them.

Empty shards: uneven splits (e.g. a length of 10 as [5, 5, 0, 0]) save, validate and load
as sources and as destinations, with any other split and world size on load.
`allow_shape_mismatch=True`: a larger requested global shape gets the stored values and
zeros past the stored end (megatron-core zero-initializes such destinations); a smaller one
gets the leading part; rigid tensors raise on every rank for both.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from dist_checkpointing.errors import CheckpointingException, ShardingIntegrityError
from tests.distributed._behaviour_fns import (
    Piece,
    global_tensor,
    load_columns,
    load_pieces,
    save_columns,
    save_pieces,
)

pytestmark = pytest.mark.timeout(240)


def _rows(sizes: List[int], cols: int = 3) -> List[List[Piece]]:
    """One piece per rank: consecutive row blocks of the given sizes (0 = an empty shard)."""
    out, start = [], 0
    for n in sizes:
        out.append([((start, 0), (n, cols))])
        start += n
    return out


# (save world, save layout, load world, load layout) on a 10 x 3 tensor
EMPTY_CASES = {
    "1_rank_empty_and_full_pieces": (1, [[((0, 0), (0, 3)), ((0, 0), (10, 3)), ((10, 0), (0, 3))]],
                                     1, [[((3, 0), (0, 0)), ((0, 0), (4, 3)), ((4, 0), (6, 3))]]),
    "4_ranks_5_5_0_0_to_2_ranks_0_10": (4, _rows([5, 5, 0, 0]), 2, _rows([0, 10])),
    "2_ranks_10_0_to_4_ranks_0_3_0_7": (2, _rows([10, 0]), 4, _rows([0, 3, 0, 7])),
    "4_ranks_0_0_0_10_to_1_rank": (4, _rows([0, 0, 0, 10]), 1, _rows([10])),
    "2_ranks_column_empty_to_4_ranks_rows": (
        2, [[((0, 0), (10, 3))], [((0, 3), (10, 0))]], 4, _rows([2, 0, 8, 0]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_empty_shards_save_validate_and_load(case, world_factory, tmp_path):
    save_world, save_layout, load_world, load_layout = EMPTY_CASES[case]
    root = str(tmp_path / "ckpt")
    world_factory(save_world).run_ok(save_pieces, root, "w", (10, 3), save_layout, timeout=120)
    problems = world_factory(load_world).run_ok(
        load_pieces, root, "w", (10, 3), load_layout, timeout=120
    )
    assert problems == [[]] * load_world


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_empty_global_tensor_round_trips(world_size, world_factory, tmp_path):
    layout = [[((0, 0), (0, 3))] for _ in range(world_size)]
    root = str(tmp_path / "ckpt")
    world = world_factory(world_size)
    world.run_ok(save_pieces, root, "w", (0, 3), layout, timeout=120)
    assert world.run_ok(load_pieces, root, "w", (0, 3), layout, timeout=120) == [[]] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_empty_shards_leaving_a_gap_raise_on_every_rank(world_size, world_factory, tmp_path):
    layout = _rows([5, 4] + [0] * (world_size - 2))  # one row of 10 is held by no rank
    outcomes = world_factory(world_size).run(
        save_pieces, str(tmp_path / "ckpt"), "w", (10, 3), layout, timeout=120
    )
    for o in outcomes:
        assert isinstance(o.error, ShardingIntegrityError), o.trace
        assert "'w'" in str(o.error) and "gap" in str(o.error)


# (save world, load world, requested columns)
MISMATCH_CASES = [(4, 2, 18), (4, 2, 14), (2, 1, 20), (1, 4, 12), (2, 4, 24), (4, 4, 8)]


@pytest.mark.parametrize("save_world,load_world,cols", MISMATCH_CASES)
def test_shape_mismatch_loads_stored_values_and_zeros_past_the_end(
    save_world, load_world, cols, world_factory, tmp_path
):
    root = str(tmp_path / "ckpt")
    world_factory(save_world).run_ok(save_columns, root, "emb", 2, 16, timeout=120)
    got = world_factory(load_world).run_ok(load_columns, root, "emb", 2, cols, True, timeout=120)
    want = torch.zeros(2, cols)
    stored = global_tensor((2, 16))
    n = min(cols, 16)
    want[:, :n] = stored[:, :n]
    assert torch.equal(torch.cat(got, dim=1), want)


@pytest.mark.parametrize("save_world,load_world,cols", [(4, 2, 18), (4, 2, 14), (2, 1, 12)])
def test_shape_mismatch_raises_on_every_rank_when_tensor_is_rigid(
    save_world, load_world, cols, world_factory, tmp_path
):
    root = str(tmp_path / "ckpt")
    world_factory(save_world).run_ok(save_columns, root, "emb", 2, 16, timeout=120)
    outcomes = world_factory(load_world).run(load_columns, root, "emb", 2, cols, False, timeout=120)
    for o in outcomes:
        assert isinstance(o.error, CheckpointingException), o.trace
        assert "Global shape mismatch" in str(o.error) and "'emb'" in str(o.error)
