"""Sharding integrity is a pure function of metadata: tested here without processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dist_checkpointing.errors import ShardingIntegrityError
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.validation import (
    StrictHandling,
    find_sharding_problems,
    parse_strict_flag,
    validate_sharding_integrity,
)
from tests._sharding import DTYPES, shardings


def _meta(shape, dtype, per_rank, prepend=0):
    out = []
    for boxes in per_rank:
        out.append(
            [
                ShardedTensor(
                    "t", None, dtype, size[prepend:], shape, offset, None, replica, prepend
                )
                for offset, size, replica in boxes
            ]
        )
    return out


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, world=st.integers(1, 6), dtype=st.sampled_from(DTYPES))
def test_any_generated_sharding_is_valid(data, shape, world, dtype):
    per_rank = data.draw(shardings(shape, 0, world))
    assert find_sharding_problems(_meta(shape, dtype, per_rank)) == []


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, world=st.integers(1, 4))
def test_dropping_a_main_box_is_a_gap(data, shape, world):
    per_rank = data.draw(shardings(shape, 0, world, replicas=False, empties=False))
    assume(sum(len(b) for b in per_rank) >= 2)  # with one box, dropping it removes the key entirely
    ranks = [r for r, boxes in enumerate(per_rank) if boxes]
    r = data.draw(st.sampled_from(ranks))
    per_rank[r].pop(data.draw(st.integers(0, len(per_rank[r]) - 1)))
    problems = find_sharding_problems(_meta(shape, torch.float32, per_rank))
    assert problems and ("gap" in problems[0] or "no rank holds" in problems[0])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, world=st.integers(1, 4))
def test_duplicating_a_main_box_is_an_overlap(data, shape, world):
    per_rank = data.draw(shardings(shape, 0, world, replicas=False, empties=False))
    src = data.draw(st.sampled_from([r for r, b in enumerate(per_rank) if b]))
    box = data.draw(st.sampled_from(per_rank[src]))
    per_rank[data.draw(st.integers(0, world - 1))].append(box)
    problems = find_sharding_problems(_meta(shape, torch.float32, per_rank))
    assert problems and "overlap" in problems[0]


def test_empty_shards_are_no_overlap_and_no_gap():
    # 10 rows as [5, 5, 0, 0]: the two empty shards sit at the same offset (10,)
    per_rank = [[((0,), (5,), 0)], [((5,), (5,), 0)], [((10,), (0,), 0)], [((10,), (0,), 0)]]
    assert find_sharding_problems(_meta((10,), torch.float32, per_rank)) == []
    per_rank[1] = [((5,), (4,), 0)]
    assert "gap" in find_sharding_problems(_meta((10,), torch.float32, per_rank))[0]


def test_partial_overlap_is_found_even_when_volumes_add_up():
    per_rank = [[((0,), (3,), 0)], [((2,), (2,), 0)]]  # 3 + 2 != 4, overlap at element 2
    assert "overlap" in find_sharding_problems(_meta((4,), torch.float32, per_rank))[0]


def test_scalar_tensor_with_two_main_replicas_overlaps():
    per_rank = [[((), (), 0)], [((), (), 0)]]
    assert "overlap" in find_sharding_problems(_meta((), torch.float32, per_rank))[0]


def test_disagreeing_dtype_and_shape_are_named():
    a = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2)).without_data()
    b = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(2, dtype=torch.int8), (0, 1, 2)
    ).without_data()
    with pytest.raises(ShardingIntegrityError, match="dtype torch.int8 on rank 1"):
        validate_sharding_integrity([[a], [b]])
    c = ShardedTensor.from_rank_offsets("w", torch.zeros(3), (0, 1, 2)).without_data()
    with pytest.raises(ShardingIntegrityError, match="global_shape"):
        validate_sharding_integrity([[a], [c]])


def test_sharded_objects_need_exactly_one_main_replica_per_cell():
    objs = [ShardedObject("o", None, (2,), (i,)) for i in range(2)]
    assert find_sharding_problems([[objs[0]], [objs[1]]]) == []
    assert "gap" in find_sharding_problems([[objs[0]], []])[0]
    assert "main replicas on ranks 0 and 1" in find_sharding_problems([[objs[0]], [objs[0]]])[0]
    assert (
        find_sharding_problems(
            [[objs[0]], [objs[1], ShardedObject("o", None, (2,), (0,), replica_id=1)]]
        )
        == []
    )


def test_key_used_as_tensor_and_object_is_a_problem():
    t = ShardedTensor.from_rank_offsets("k", torch.zeros(1)).without_data()
    o = ShardedObject("k", None, (1,), (0,))
    assert any("both" in p for p in find_sharding_problems([[t, o]]))


def test_strict_flag_parsing():
    assert parse_strict_flag("raise_all") is StrictHandling.RAISE_ALL
    assert parse_strict_flag(StrictHandling.LOG_ALL) is StrictHandling.LOG_ALL
    with pytest.raises(ValueError, match="assume_ok_unexpected"):
        parse_strict_flag("sometimes")
    assert StrictHandling.requires_returning_mismatch_keys(StrictHandling.RETURN_UNEXPECTED)
    assert not StrictHandling.requires_explicit_ckpt_mismatch_check(
        StrictHandling.ASSUME_OK_UNEXPECTED
    )
    assert StrictHandling.requires_global_app_metadata(StrictHandling.RAISE_ALL)


def test_overlap_check_scales_to_many_shards():
    n = 2048
    per_rank = [[((i * 4,), (4,), 0)] for i in range(n)]
    assert find_sharding_problems(_meta((4 * n,), torch.float32, per_rank)) == []
