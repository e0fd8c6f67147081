"""ShardedTensor / ShardedObject construction, validation and geometry helpers."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)


def test_from_rank_offsets_computes_global_geometry():
    sh = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(4, 3), (0, 2, 5), (1, 1, 2), replica_id=(0, 1)
    )
    assert sh.global_shape == (20, 6)
    assert sh.global_offset == (8, 3)
    assert sh.axis_fragmentations == (5, 2)
    assert sh.local_shape == (4, 3)
    assert sh.global_slice() == (slice(8, 12), slice(3, 6))
    assert sh.local_chunk_offset_in_global() == (2, 1)
    assert sh.max_allowed_chunks() == (4, 3)
    assert not is_main_replica(sh.replica_id)


def test_from_rank_offsets_with_prepended_axis():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, 3, 8), prepend_axis_num=1)
    assert sh.global_shape == (8, 4, 3)
    assert sh.global_offset == (3, 0, 0)
    assert sh.prepended_local_shape == (1, 4, 3)
    assert sh.global_slice() == (3, slice(0, 4), slice(0, 3))
    assert sh.local_chunk_offset_in_global() == (3, 0, 0)


@pytest.mark.parametrize(
    "rank_offsets",
    [((0, 2, 2),), ((0, -1, 2),), ((0, 0, 0),), ((2, 0, 2),), ((0, 0, 2), (0, 1, 2))],
)
def test_from_rank_offsets_rejects_invalid_positions(rank_offsets):
    with pytest.raises(CheckpointingException, match="Invalid rank offsets"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), *rank_offsets)


def test_from_rank_offsets_rejects_flattened_range():
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"global_shape": (4,), "global_offset": (0,)}, "does not match global_shape"),
        ({"global_offset": (0,)}, "different lengths"),
        ({"global_offset": (1, 0)}, "exceeds global_shape"),
        ({"local_shape": (3, 3)}, "differs from local_shape"),
        ({"dtype": torch.float16}, "differs from dtype"),
        ({"key": ""}, "non-empty"),
        ({"replica_id": -1}, "replica_id"),
        ({"axis_fragmentations": (1,)}, "axis_fragmentations"),
        ({"global_offset": (-1, 0)}, "non-negative"),
    ],
)
def test_invalid_metadata_is_rejected_at_construction(kwargs, match):
    args = dict(
        key="w",
        data=torch.zeros(4, 3),
        dtype=torch.float32,
        local_shape=(4, 3),
        global_shape=(4, 3),
        global_offset=(0, 0),
        axis_fragmentations=(1, 1),
    )
    args.update(kwargs)
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor(**args)


def test_irregular_shard_without_axis_fragmentations_is_valid():
    sh = ShardedTensor("w", torch.zeros(3, 2), torch.float32, (3, 2), (10, 2), (5, 0), None)
    assert not sh.has_regular_grid
    with pytest.raises(CheckpointingException):
        sh.local_chunk_offset_in_global()


def test_without_data_init_data_and_narrow():
    sh = ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(4, 3), (0, 1, 2))
    meta = sh.without_data()
    assert meta.data is None and meta.global_shape == sh.global_shape
    meta.init_data("cpu", torch.ones)
    assert torch.equal(meta.data, torch.ones(4, 3))
    (narrowed,) = sh.narrow(0, 1, 2)
    assert narrowed.global_shape == (4, 3) and narrowed.global_offset == (2, 0)
    assert torch.equal(narrowed.data, sh.data[1:3])


def test_sharded_object_unique_key_round_trips():
    obj = ShardedObject("opt/state", {"x": 1}, (2, 3), (1, 2))
    assert obj.unique_key == "opt/state/shard_1.2_2.3"
    back = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (back.key, back.global_shape, back.global_offset, back.data) == (
        "opt/state",
        (2, 3),
        (1, 2),
        None,
    )


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../b", "a//b", "a\\b", "", "a/./b"])
def test_sharded_object_rejects_unsafe_keys(key):
    with pytest.raises(CheckpointingException):
        ShardedObject(key, None, (1,), (0,))


def test_sharded_object_rejects_offset_outside_grid():
    with pytest.raises(CheckpointingException, match="outside"):
        ShardedObject("k", None, (2,), (2,))


@pytest.mark.parametrize("bad", ["nope", "k/shard_1_x", "k/tile_0_1", "noslash"])
def test_empty_from_unique_key_rejects_malformed(bad):
    with pytest.raises(CheckpointingException, match="Malformed"):
        ShardedObject.empty_from_unique_key(bad)


def test_factories_build_and_merge_back():
    def build(key, data, replica_id, flattened_range):
        return {
            "lo": ShardedTensor.from_rank_offsets(f"{key}.lo", data[:2], replica_id=replica_id),
            "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", data[2:], replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["lo"], sub["hi"]])

    factory = ShardedTensorFactory("f", torch.arange(4.0), build, merge)
    sd = {"f": factory, "x": [LocalNonpersistentObject(3)]}
    apply_factories(sd)
    assert set(sd["f"]) == {"lo", "hi"} and sd["f"]["hi"].key == "f.hi"
    loaded = {"f": {"lo": torch.tensor([0.0, 1.0]), "hi": torch.tensor([2.0, 3.0])}}
    apply_factory_merges(loaded, {"f": factory})
    assert torch.equal(loaded["f"], torch.arange(4.0))
    assert sd["x"][0].unwrap() == 3
