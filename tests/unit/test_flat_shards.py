"""Flat shards (`flattened_range`, megatron-core <= 0.13's distributed optimizer layout):
the data model, the split of a flat range into boxes, and single-process round trips."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing._flat import flat_range_boxes
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.mapping import ShardedTensor


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_flat_range_splits_into_contiguous_boxes_covering_it_once(case):
    shape, start, stop = case
    index = torch.arange(math.prod(shape)).view(shape)
    seen = []
    for offset, size, flat_start in flat_range_boxes(shape, start, stop):
        box = index[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        # each box is one contiguous run of the flat order, in order
        assert box.flatten().tolist() == list(range(flat_start, flat_start + box.numel()))
        seen += box.flatten().tolist()
    assert seen == list(range(start, stop))
    assert len(flat_range_boxes(shape, start, stop)) <= max(1, 2 * len(shape) - 1)


def test_from_rank_offsets_flat_builds_the_grid_piece_and_its_range():
    sh = ShardedTensor.from_rank_offsets_flat(
        "k", torch.arange(5.0), (3, 4), (0, 1, 2), flattened_range=slice(5, 10)
    )
    assert (sh.local_shape, sh.global_shape, sh.global_offset) == ((3, 4), (6, 4), (3, 0))
    assert sh.flattened_range == slice(5, 10) and sh.axis_fragmentations == (2, 1)
    empty = ShardedTensor(
        "k", None, torch.float32, (3, 4), (6, 4), (3, 0), None, 0, 0, False, slice(2, 9)
    )
    empty.init_data("cpu")
    assert empty.data is not None and empty.data.shape == (7,)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: ShardedTensor.from_rank_offsets_flat("k", torch.ones(5), (3, 4)), "non-flat"),
        (
            lambda: ShardedTensor.from_rank_offsets_flat(
                "k", torch.ones(5, 1), (3, 4), flattened_range=slice(0, 5)
            ),
            "1-D",
        ),
        (
            lambda: ShardedTensor.from_rank_offsets_flat(
                "k", torch.ones(4), (3, 4), flattened_range=slice(0, 5)
            ),
            "length",
        ),
        (
            lambda: ShardedTensor.from_rank_offsets_flat(
                "k", torch.ones(5), (3, 4), flattened_range=slice(10, 15)
            ),
            "within the 12 elements",
        ),
        (
            lambda: ShardedTensor.from_rank_offsets_flat(
                "k", torch.ones(4), (3, 4), flattened_range=slice(0, 4, 2)
            ),
            "without step",
        ),
        (
            lambda: ShardedTensor.from_rank_offsets(
                "k", torch.ones(3, 4), flattened_range=slice(0, 12)
            ),
            "from_rank_offsets_flat",
        ),
    ],
)
def test_invalid_flat_shards_are_rejected_at_construction(build, match):
    with pytest.raises(CheckpointingException, match=match):
        build()


def _flat_pieces(g: torch.Tensor, ranges):
    """A (6, 4) tensor as two row pieces, each split into the given flat ranges."""
    sd = {}
    for piece in range(2):
        chunk = g[piece * 3 : (piece + 1) * 3].flatten()
        for j, (a, b) in enumerate(ranges):
            sd[f"p{piece}_{j}"] = ShardedTensor.from_rank_offsets_flat(
                "w", chunk[a:b].clone(), (3, 4), (0, piece, 2), flattened_range=slice(a, b)
            )
    return sd


def test_flat_shards_round_trip_through_any_layout(tmp_path):
    g = torch.arange(24, dtype=torch.float32).view(6, 4)
    dc.save(_flat_pieces(g, [(0, 5), (5, 5), (5, 12)]), tmp_path / "flat")
    dc.save({"w": ShardedTensor.from_rank_offsets("w", g.clone())}, tmp_path / "plain")
    # the metadata of a flat checkpoint is the unflattened tensor's
    assert str(dc.load_tensors_metadata(tmp_path / "flat")["w"]) == str(
        dc.load_tensors_metadata(tmp_path / "plain")["w"]
    )
    for ckpt in ("flat", "plain"):
        whole = dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6, 4))}, tmp_path / ckpt
        )
        assert torch.equal(whole["w"], g)
        flat = dc.load(_flat_pieces(torch.zeros(6, 4), [(0, 7), (7, 12)]), tmp_path / ckpt)
        want = _flat_pieces(g, [(0, 7), (7, 12)])
        assert all(torch.equal(flat[k], want[k].data) for k in want)
