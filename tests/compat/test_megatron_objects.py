"""megatron-core's mapping objects as input to our entry points (no megatron needed).

`_fake_megatron` mirrors megatron-core's classes (module path and fields); the real ones are
exercised with megatron-core's GPTModel in tests/interop.
"""

from __future__ import annotations

import os

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import megatron_compat
from dist_checkpointing.errors import UnsupportedShardedObjectError
from dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.validation import determine_global_metadata
from tests.compat import _fake_megatron as fake

pytestmark = pytest.mark.timeout(120)


def _mc_state(w: torch.Tensor, layers: torch.Tensor) -> dict:
    return {
        "w": fake.ShardedTensor.from_rank_offsets("w", w, (0, 0, 1)),
        "layers": fake.ShardedTensor.from_rank_offsets("layers", layers, prepend_axis_num=1),
        "obj": fake.ShardedObject("rng", {"seed": 3}, (1,), (0,)),
        "local": fake.LocalNonpersistentObject("kept locally"),
        "iteration": 9,
    }


def test_megatron_objects_convert_to_ours_sharing_data():
    w = torch.arange(6.0).reshape(2, 3)
    sd = _mc_state(w, torch.ones(3))
    out = megatron_compat.convert_sharded_state_dict(dict(sd))
    assert isinstance(out["w"], ShardedTensor) and out["w"].data is w
    assert out["layers"].prepend_axis_num == 1 and out["layers"].global_shape == (1, 3)
    assert isinstance(out["obj"], ShardedObject) and out["obj"].data == {"seed": 3}
    assert isinstance(out["local"], LocalNonpersistentObject)
    assert out["local"].unwrap() == "kept locally"
    assert isinstance(sd["w"], fake.ShardedTensor)  # the caller's tree is untouched


def test_save_and_load_of_megatron_objects_equal_ours(tmp_path):
    w, layers = torch.arange(6.0).reshape(2, 3), torch.arange(3.0)
    dc.save(_mc_state(w, layers), tmp_path / "ckpt")
    assert dc.load_common_state_dict(tmp_path / "ckpt") == {"iteration": 9}
    request = _mc_state(torch.zeros(2, 3), torch.zeros(3))
    out = dc.load(request, tmp_path / "ckpt")
    assert torch.equal(out["w"], w) and torch.equal(out["layers"], layers)
    assert torch.equal(request["w"].data, w)  # loaded in place into megatron's tensor
    assert out["obj"] == {"seed": 3} and out["iteration"] == 9
    assert out["local"] == "kept locally"
    meta = dc.load_tensors_metadata(tmp_path / "ckpt")
    assert set(meta) == {"w", "layers"}


def test_megatron_tensor_after_megatrons_own_save_keeps_working(tmp_path):
    # megatron's save leaves prepended axes on `data`; the same objects still save with us
    sh = fake.ShardedTensor.from_rank_offsets("layers", torch.arange(3.0), prepend_axis_num=1)
    sh.data = sh.data.view(1, 3)
    dc.save({"layers": sh}, tmp_path / "ckpt")
    out = dc.load(
        {"layers": ShardedTensor.from_rank_offsets("layers", torch.zeros(3), prepend_axis_num=1)},
        tmp_path / "ckpt",
    )
    assert torch.equal(out["layers"], torch.arange(3.0))


def test_megatron_factory_builds_megatron_objects_that_are_converted(tmp_path):
    def build(key, data, replica_id, flattened_range):
        return {
            "a": fake.ShardedTensor.from_rank_offsets(f"{key}.a", data[:1].clone()),
            "b": fake.ShardedTensor.from_rank_offsets(f"{key}.b", data[1:].clone()),
        }

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    data = torch.arange(4.0)
    dc.save({"f": fake.ShardedTensorFactory("f", data, build, merge)}, tmp_path / "ckpt")
    assert set(dc.load_tensors_metadata(tmp_path / "ckpt")) == {"f.a", "f.b"}
    out = dc.load(
        {"f": fake.ShardedTensorFactory("f", torch.zeros(4), build, merge)}, tmp_path / "ckpt"
    )
    assert torch.equal(out["f"], data)


def _hidden(w: torch.Tensor, v: torch.Tensor) -> dict:
    return {
        "extra": {
            "nested": [{"deep": fake.ShardedTensor.from_rank_offsets("hidden", w)}],
            "listed": [fake.ShardedTensor.from_rank_offsets("in_list", v)],
            "plain": [1, 2],
        }
    }


def test_megatron_tensor_hidden_in_common_dicts_and_lists_goes_sharded(tmp_path):
    w, v = torch.arange(4.0), torch.arange(3.0)
    dc.save(_hidden(w, v), tmp_path / "ckpt")
    assert set(dc.load_tensors_metadata(tmp_path / "ckpt")) == {"hidden", "in_list"}
    common = dc.load_common_state_dict(tmp_path / "ckpt")
    assert common == {"extra": {"plain": [1, 2]}}
    out = dc.load(_hidden(torch.zeros(4), torch.zeros(3)), tmp_path / "ckpt")
    assert torch.equal(out["extra"]["nested"][0]["deep"], w)
    assert torch.equal(out["extra"]["listed"][0], v)


@pytest.mark.parametrize(
    "leaf, fragment",
    [
        (
            fake.ShardedTensorV99("v99", torch.ones(2), torch.float32, (2,), (2,), (0,), (1,)),
            "unknown megatron-core class",
        ),
        (fake.LookAlike("looks"), "LookAlike"),
    ],
    ids=["unknown-megatron-class", "look-alike"],
)
def test_unhandled_sharded_looking_leaf_raises_naming_its_key_when_saved(tmp_path, leaf, fragment):
    with pytest.raises(UnsupportedShardedObjectError, match=fragment) as info:
        dc.save({"outer": [0, {"inner": leaf}]}, tmp_path / "ckpt")
    assert "outer/1/inner" in str(info.value)
    assert not os.path.exists(tmp_path / "ckpt" / "common.pt")


def test_megatron_flat_shards_convert_and_round_trip(tmp_path):
    # megatron-core <= 0.13's distributed optimizer: two flat ranges of a (2, 3) piece
    full = torch.arange(6.0).view(2, 3)
    flat = [
        fake.ShardedTensor(
            "flat", full.flatten()[a:b].clone(), torch.float32, (2, 3), (2, 3), (0, 0), None,
            flattened_range=slice(a, b),
        )
        for a, b in ((0, 4), (4, 6))
    ]  # fmt: skip
    dc.save({"opt": flat}, tmp_path / "ckpt")
    assert torch.equal(dc.load_plain_tensors(tmp_path / "ckpt")["flat"], full)


def test_sharded_leaf_inside_a_tuple_raises_instead_of_being_pickled(tmp_path):
    sh = fake.ShardedTensor.from_rank_offsets("t", torch.ones(2))
    with pytest.raises(UnsupportedShardedObjectError, match=r"pair\[1\]"):
        dc.save({"pair": (1, sh)}, tmp_path / "ckpt")
    ours = ShardedTensor.from_rank_offsets("t", torch.ones(2))
    with pytest.raises(UnsupportedShardedObjectError, match="inside a tuple"):
        dc.save({"pair": (1, [ours])}, tmp_path / "ckpt")


def test_load_with_unhandled_leaf_raises_naming_its_key(tmp_path):
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "ckpt")
    with pytest.raises(UnsupportedShardedObjectError, match="bad"):
        dc.load(
            {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2)), "bad": fake.LookAlike("x")},
            tmp_path / "ckpt",
        )


def test_validation_accepts_megatron_objects():
    local, everyone = determine_global_metadata(_mc_state(torch.ones(2, 3), torch.ones(3)))
    assert {type(x) for x in local} == {ShardedTensor, ShardedObject}
    assert len(everyone) == 1


def test_plain_values_never_look_sharded():
    for value in (torch.ones(2), 3, "s", b"b", {"key": 1}, [1], (1, 2), None, 1.5):
        assert not megatron_compat.looks_sharded(value)
    assert megatron_compat.looks_sharded(
        ShardedTensorFactory("k", torch.ones(1), lambda *a: {}, lambda s: s)
    )


def test_unhandled_leaf_on_one_rank_raises_naming_its_key_on_every_rank(world_factory, tmp_path):
    from tests.compat import _compat_fns

    out = world_factory(2).run_ok(
        _compat_fns.save_with_unhandled_leaf_on_one_rank, str(tmp_path / "c")
    )
    for message in out:
        assert message.startswith("UnsupportedShardedObjectError"), message
        assert "extra/inner/0" in message and "LookAlike" in message
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_megatron_tensor_hidden_in_common_goes_sharded_across_ranks(world_factory, tmp_path):
    from tests.compat import _compat_fns

    out = world_factory(2).run_ok(
        _compat_fns.save_and_load_hidden_megatron_tensors, str(tmp_path / "c")
    )
    for loaded_ok, common in out:
        assert loaded_ok
        assert common == {"step": 3}  # no tensor (nor its empty containers) in the common state
