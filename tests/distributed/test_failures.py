"""Bad input and broken checkpoints raise a CheckpointingException on every rank, never hang."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import (
    CheckpointExistsError,
    CheckpointingException,
    IncompatibleCheckpointError,
    KeyMismatchError,
    NotACheckpointError,
    ShardingIntegrityError,
    StrategyNotFoundError,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.validation import StrictHandling
from tests.distributed._rank_fns import call_load, call_save

pytestmark = pytest.mark.timeout(120)
WORLD = 2


def _rank() -> int:
    return dist.get_rank()


def good_state() -> Dict[str, Any]:
    r, w = _rank(), dist.get_world_size()
    local = (
        torch.arange(8 * 4, dtype=torch.float32)
        .reshape(8, 4)[:, r * (4 // w) : (r + 1) * (4 // w)]
        .clone()
    )
    return {
        "a": ShardedTensor.from_rank_offsets("a", local, (1, r, w)),
        "b": ShardedTensor.from_rank_offsets("b", torch.ones(3), replica_id=r),
        "obj": ShardedObject("rng", {"seed": r}, (w,), (r,)),
        "step": 7,
    }


def request_only_a() -> Dict[str, Any]:
    r, w = _rank(), dist.get_world_size()
    return {"a": ShardedTensor.from_rank_offsets("a", torch.empty(8, 4 // w), (1, r, w))}


def request_with_unexpected_on_rank1() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.empty(2), replica_id=1)
    return sd


def overlap_state() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(4))
    }  # every rank claims the whole tensor as main


def gap_state() -> Dict[str, Any]:
    if _rank() == 0:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, 0, 2))}
    return {}


def dtype_disagreement_state() -> Dict[str, Any]:
    dtype = torch.float32 if _rank() == 0 else torch.float16
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, dtype=dtype), (0, _rank(), 2))}


def shape_disagreement_state() -> Dict[str, Any]:
    n = 4 if _rank() == 0 else 5
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(n), (0, _rank(), 2))}


def escaping_object_state() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["obj"].key = "../../outside"  # bypasses construction-time checks on one rank only
    return sd


def none_data_on_rank1_state() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["a"].data = None
    return sd


def _assert_all_raise(outcomes: List[Any], cls: type, match: str = "") -> None:
    for o in outcomes:
        assert o.error is not None, f"rank {o.rank} did not raise"
        assert isinstance(o.error, cls), f"rank {o.rank}: {type(o.error).__name__}: {o.error}"
        assert match in str(o.error), f"rank {o.rank}: {o.error}"


@pytest.fixture
def world(world_factory):
    return world_factory(WORLD)


@pytest.fixture
def saved(world, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    world.run_ok(call_save, good_state, ckpt)
    return ckpt


@pytest.mark.parametrize(
    "builder,match",
    [
        (overlap_state, "overlap"),
        (gap_state, "gap"),
        (dtype_disagreement_state, "dtype"),
        (shape_disagreement_state, "global_shape"),
    ],
)
def test_save_rejects_invalid_sharding_on_every_rank(world, tmp_path, builder, match):
    outcomes = world.run(call_save, builder, str(tmp_path / "c"))
    _assert_all_raise(outcomes, ShardingIntegrityError, match)
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")


def test_load_rejects_overlapping_request_on_every_rank(world, saved):
    _assert_all_raise(world.run(call_load, overlap_state, saved), ShardingIntegrityError, "overlap")


@pytest.mark.parametrize("strategy", [("nope", 1), ("torch_dist", 99)])
def test_save_with_unknown_backend_or_version_raises_naming_it(world, tmp_path, strategy):
    outcomes = world.run(call_save, good_state, str(tmp_path / "c"), {"sharded_strategy": strategy})
    _assert_all_raise(
        outcomes, StrategyNotFoundError, f"backend={strategy[0]!r}, version={strategy[1]}"
    )
    assert "Registered:" in str(outcomes[0].error) and "torch_dist" in str(outcomes[0].error)


def _rewrite_config(ckpt: str, **fields: Any) -> None:
    path = os.path.join(ckpt, "metadata.json")
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    "fields",
    [{"sharded_backend": "nope"}, {"sharded_backend_version": 7}, {"common_backend_version": 3}],
)
def test_load_of_checkpoint_with_unknown_backend_or_version_raises(world, saved, fields):
    _rewrite_config(saved, **fields)
    outcomes = world.run(call_load, good_state, saved)
    _assert_all_raise(outcomes, StrategyNotFoundError, str(list(fields.values())[0]))


def test_explicit_strategy_refuses_incompatible_version(world, saved):
    _rewrite_config(saved, sharded_backend_version=2)
    outcomes = world.run(
        call_load, good_state, saved, {"sharded_strategy": TorchDistLoadShardedStrategy()}
    )
    _assert_all_raise(outcomes, IncompatibleCheckpointError, "version 2")


def test_load_of_directory_that_is_not_a_checkpoint_raises(world, tmp_path):
    _assert_all_raise(
        world.run(call_load, good_state, str(tmp_path / "absent")),
        NotACheckpointError,
        "does not exist",
    )
    (tmp_path / "empty").mkdir()
    _assert_all_raise(
        world.run(call_load, good_state, str(tmp_path / "empty")),
        NotACheckpointError,
        "no metadata.json",
    )


def test_checkpoint_without_metadata_json_is_not_loaded(world, saved):
    os.remove(os.path.join(saved, "metadata.json"))
    assert not dc.check_is_distributed_checkpoint(saved)
    _assert_all_raise(
        world.run(call_load, good_state, saved), NotACheckpointError, "no metadata.json"
    )


def test_save_refuses_to_overwrite_complete_checkpoint(world, saved):
    before = sorted(os.listdir(saved))
    _assert_all_raise(
        world.run(call_save, good_state, saved), CheckpointExistsError, "refusing to overwrite"
    )
    assert sorted(os.listdir(saved)) == before


def test_sharded_object_key_escaping_directory_raises_on_every_rank(world, tmp_path):
    with pytest.raises(CheckpointingException, match="'..'"):
        ShardedObject("../evil", 1, (1,), (0,))
    outcomes = world.run(call_save, escaping_object_state, str(tmp_path / "c"))
    _assert_all_raise(outcomes, CheckpointingException, "failed on rank 1:")
    assert not (tmp_path / "outside").exists()


def test_failure_of_one_rank_during_write_raises_on_every_rank(world, tmp_path):
    outcomes = world.run(call_save, none_data_on_rank1_state, str(tmp_path / "c"))
    _assert_all_raise(outcomes, CheckpointingException, "data is None")
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")
    world.run_ok(
        call_save, good_state, str(tmp_path / "c")
    )  # a retry into the same directory succeeds
    assert dc.check_is_distributed_checkpoint(tmp_path / "c")


def test_unexpected_key_under_assume_ok_raises_on_every_rank(world, saved):
    outcomes = world.run(call_load, request_with_unexpected_on_rank1, saved)
    _assert_all_raise(outcomes, CheckpointingException, "'ghost'")


@pytest.mark.parametrize("strict", [StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL])
def test_unexpected_key_under_raising_modes_raises_on_every_rank(world, saved, strict):
    outcomes = world.run(call_load, request_with_unexpected_on_rank1, saved, {"strict": strict})
    _assert_all_raise(outcomes, KeyMismatchError, "ghost")


def test_missing_keys_raise_under_raise_all(world, saved):
    outcomes = world.run(call_load, request_only_a, saved, {"strict": "raise_all"})
    _assert_all_raise(outcomes, KeyMismatchError, "Missing keys")


@pytest.mark.parametrize(
    "strict", [StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL, StrictHandling.IGNORE_ALL]
)
def test_unexpected_key_is_skipped_under_lenient_modes(world, saved, strict):
    results = world.run_ok(call_load, request_with_unexpected_on_rank1, saved, {"strict": strict})
    for r, res in enumerate(results):
        assert "ghost" not in res and res["step"] == 7 and res["obj"] == {"seed": r}
        assert torch.equal(res["b"], torch.ones(3))


def test_return_modes_report_mismatched_keys(world, saved):
    results = world.run_ok(
        call_load, request_with_unexpected_on_rank1, saved, {"strict": "return_unexpected"}
    )
    assert [res[1:] for res in results] == [(set(), set()), (set(), {"ghost"})]
    results = world.run_ok(call_load, request_only_a, saved, {"strict": StrictHandling.RETURN_ALL})
    for sd, missing, unexpected in results:
        assert missing == {"b", "rng/shard_0_2", "rng/shard_1_2"} and unexpected == set()
        assert set(sd) == {"a", "step"}


def test_missing_data_file_raises_on_every_rank(world, saved):
    victim = next(f for f in sorted(os.listdir(saved)) if f.startswith("__1_"))
    os.remove(os.path.join(saved, victim))
    outcomes = world.run(call_load, good_state, saved)
    _assert_all_raise(outcomes, CheckpointingException, "")
    assert any("file" in str(o.error) or "read" in str(o.error) for o in outcomes)


def test_world_is_healthy_after_failures(world, tmp_path):
    ckpt = str(tmp_path / "c")
    world.run_ok(call_save, good_state, ckpt)
    results = world.run_ok(call_load, good_state, ckpt)
    assert [res["obj"] for res in results] == [{"seed": 0}, {"seed": 1}]
    shutil.rmtree(ckpt)


def save_with_rank_specific_common(ckpt: str) -> List[str]:
    import logging

    records: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("dist_checkpointing").addHandler(handler)
    try:
        sd = good_state()
        sd["lr"] = 0.1 * (1 + _rank())
        dc.save(sd, ckpt)
    finally:
        logging.getLogger("dist_checkpointing").removeHandler(handler)
    return records


def test_common_state_differences_are_logged_by_rank_0(world, tmp_path):
    logs = world.run_ok(save_with_rank_specific_common, str(tmp_path / "c"))
    assert any(
        "Common state differs between rank 0 and rank 1" in m and "'lr'" in m for m in logs[0]
    ), logs
    assert dc.load_common_state_dict(tmp_path / "c")["lr"] == 0.1
