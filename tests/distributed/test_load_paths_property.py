"""Property: random shardings on both sides load bit-exactly through every read path.

Saved with small checksum blocks and loaded with small read requests, so each item spans
several blocks and requests: the request-by-request verification and the scatter of partial
chunks are exercised on every example.
"""

from __future__ import annotations

import os
from typing import List

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import integrity
from dist_checkpointing.strategies.torch_dist import reader
from tests._sharding import Case, bitwise_equal, cases, make_global
from tests.distributed._rank_fns import rank, state_for

SETTINGS = settings(
    max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


def save_small_blocks(batch: List[Case], root: str) -> None:
    """Saves the batch with 64-byte checksum blocks (many blocks per item)."""
    saved = integrity.BLOCK
    integrity.BLOCK = 64
    try:
        dc.save(state_for(batch, "save", True), os.path.join(root, "ckpt"))
    finally:
        integrity.BLOCK = saved


def load_in_small_requests(batch: List[Case], root: str) -> List[str]:
    """Loads the batch in 48-byte requests; returns the differences."""
    saved = reader.READ_REQUEST
    reader.READ_REQUEST = 48
    try:
        loaded = dc.load(
            state_for(batch, "load", False),
            os.path.join(root, "ckpt"),
        )
    finally:
        reader.READ_REQUEST = saved
    problems = []
    r = rank()
    for i, case in enumerate(batch):
        g = make_global(case)
        for box, got in zip(case.load[r], loaded.get(f"case{i}", []), strict=True):
            offset, size = box[:2]  # a 4th element is a flat range (tests/_sharding.py)
            want = g[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(
                size[case.prepend_axis_num :]
            )
            if len(box) > 3:
                want = want.flatten()[box[3][0] : box[3][1]]
            if not bitwise_equal(got, want):
                problems.append(f"rank {r} case {i} box {box}: loaded data differs")
    return problems


def _batch(world: int, load_world: int) -> st.SearchStrategy:
    def rename(cs: list) -> list:
        return [Case(**{**c.__dict__, "key": f"t{i}.weight"}) for i, c in enumerate(cs)]

    return st.lists(cases(world, load_world=load_world), min_size=4, max_size=8).map(rename)


def empty_shards_batch(save_world: int, load_world: int) -> List[Case]:
    """Cases where ranks hold zero-size pieces when saving and when loading.

    The last saving rank and the last loading rank hold only an empty piece of the first
    tensor (as an uneven split leaves them); empty pieces sit at the start, inside and past
    the end of an axis, next to whole, partial (rows) and shared (columns) chunk reads.
    """
    cut = [8 * r // (save_world - 1) for r in range(save_world)]  # all but the last rank
    save_blocks: List[list] = [
        [((cut[r], 0), (cut[r + 1] - cut[r], 6), 0)] for r in range(save_world - 1)
    ]
    save_blocks.append([((8, 0), (0, 6), 0), ((3, 2), (4, 0), 0)])
    load_rows: List[list] = [[((0, 0), (8, 6), 0)]] + [
        [((0, 0), (0, 6), 0), ((5, 6), (3, 0), 0)] for _ in range(load_world - 1)
    ]
    cols = [[((0, 3 * r), (8, 3), 0)] for r in range(2)]  # column slices of row chunks
    load_cols = cols + [[] for _ in range(load_world - 2)]
    load_cols[-1] = load_cols[-1] + [((8, 6), (0, 0), 0)]
    return [
        Case("t0.weight", (8, 6), torch.float32, 1, 0, save_blocks, load_rows),
        Case("t1.weight", (8, 6), torch.bfloat16, 2, 0, save_blocks, load_cols),
    ]


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (4, 2)])
@pytest.mark.timeout(300)
def test_random_shardings_load_bitwise_through_every_read_path(
    save_world, load_world, world_factory, tmp_path_factory
):
    @SETTINGS
    @given(_batch(save_world, load_world))
    @example(empty_shards_batch(save_world, load_world))
    def run(batch: List[Case]) -> None:
        root = str(tmp_path_factory.mktemp("paths"))
        world_factory(save_world).run_ok(save_small_blocks, batch, root, timeout=120)
        problems = world_factory(load_world).run_ok(
            load_in_small_requests, batch, root, timeout=120
        )
        assert problems == [[]] * load_world, problems

    run()
