"""MCoreTensorAwareStateDict: the bridge from sharded state dicts to the local manager."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.local._image import decode_image, finish_image, start_image
from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from tests.local import _tasd_fns as F


def _single() -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4)),
        "b": [ShardedTensor.from_rank_offsets("b", torch.ones(5, dtype=torch.int64))],
        "obj": ShardedObject("obj", [1, 2], (1,), (0,)),
        "step": 3,
    }


def test_pop_insert_and_guards_leave_the_callers_state_alone():
    sd = _single()
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")
    assert distribution is None and tasd.common_state_dict == {"step": 3}
    popped = tasd.pop_tensors()
    assert tasd.is_hollow and [tuple(t.shape) for t in popped] == [(3, 4), (5,)]
    assert sd["w"].data is not None  # the caller's ShardedTensor keeps its data
    with pytest.raises(CheckpointingException, match="hollow"):
        tasd.pop_tensors()
    with pytest.raises(CheckpointingException, match="shape"):
        tasd.insert_tensors([torch.zeros(4, 3), popped[1]])
    with pytest.raises(CheckpointingException, match="2 stored shards"):
        tasd.insert_tensors(popped[:1])
    tasd.insert_tensors(popped)
    assert not tasd.is_hollow and tasd.tensors[0] is popped[0]
    tasd.copy_tensors_to_cpu()
    assert tasd.tensors[0] is not popped[0] and torch.equal(tasd.tensors[0], popped[0])
    tasd.pop_tensors()
    tasd.init_tensors()
    assert [t.dtype for t in tasd.tensors] == [torch.float32, torch.int64]


def test_hollow_state_survives_the_local_image_with_a_cleared_allowlist():
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_single(), algo="atomic")
    image = finish_image(start_image(tasd, (1, 0, "s"), tasd.tensor_names()))
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        _, back = decode_image(image.buffer, "mem")
    finally:
        torch.serialization.add_safe_globals(saved)
    assert isinstance(back, MCoreTensorAwareStateDict)
    request = _single()
    out = back.to_state_dict(request, algo="atomic", validate_access_integrity=False)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
    assert out["obj"] == [1, 2] and out["step"] == 3


def test_unknown_algo_and_missing_shard_are_named():
    with pytest.raises(CheckpointingException, match="algo"):
        MCoreTensorAwareStateDict.from_state_dict(_single(), algo="magic")
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_single(), algo="atomic")
    request = _single()
    request["x"] = ShardedTensor.from_rank_offsets("x", torch.zeros(2))
    with pytest.raises(CheckpointingException, match="'x'"):
        tasd.to_state_dict(request, validate_access_integrity=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algo,is_async", [("atomic", False), ("fully_parallel", True)])
def test_round_trip_through_the_local_manager(world_factory, tmp_path, algo, is_async):
    world = world_factory(2)
    results = world.run_ok(F.round_trip, str(tmp_path / algo), algo, is_async, timeout=120)
    assert all(ok and kept for _, _, ok, kept in results)
    names = [set(r[0]) for r in results]
    replicated = {"emb@(0, 0)"} | {f"norm{i}@(0,)" for i in range(4)}
    if algo == "atomic":
        assert all(replicated <= n for n in names)
    else:  # each replicated shard stored once, bytes spread over both ranks
        assert names[0] & names[1] == set() and replicated <= names[0] | names[1]
        assert min(r[1] for r in results) > 0


@pytest.mark.timeout(240)
def test_a_shard_no_rank_stored_fails_on_every_rank(world_factory, tmp_path):
    world = world_factory(2)
    for name, message in world.run_ok(F.missing_shard_error, str(tmp_path), timeout=120):
        assert "never_saved" in message, (name, message)
