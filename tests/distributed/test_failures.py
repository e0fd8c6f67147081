"""Bad input and broken checkpoints raise a CheckpointingException on every rank, never hang."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, List

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject
from dist_checkpointing.core import CheckpointingConfig, save_config
from dist_checkpointing.errors import (
    CheckpointCorruptedError,
    CheckpointExistsError,
    CheckpointingException,
    IncompatibleCheckpointError,
    KeyMismatchError,
    NotACheckpointError,
    ShardingIntegrityError,
    StrategyNotFoundError,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.tools import verify_checkpoint
from dist_checkpointing.validation import StrictHandling
from tests.distributed._failure_fns import (
    _rank,
    assert_all_raise,
    dtype_disagreement_state,
    escaping_object_state,
    gap_state,
    good_state,
    load_with_common_failing_on_rank1,
    none_data_on_rank1_state,
    overlap_state,
    request_a_here_b_on_rank1,
    request_only_a,
    request_with_unexpected_on_rank1,
    shape_disagreement_state,
)
from tests.distributed._rank_fns import call_load, call_save

pytestmark = pytest.mark.timeout(120)


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
    outcomes = world.run(call_save, builder, str(tmp_path / "new" / "c"))
    assert_all_raise(outcomes, ShardingIntegrityError, match)
    assert os.listdir(tmp_path) == []  # refused before writing: nothing the save created is left
    (tmp_path / "mine").mkdir()  # a directory the save did not create is kept
    assert_all_raise(world.run(call_save, builder, str(tmp_path / "mine")), ShardingIntegrityError)
    assert os.listdir(tmp_path) == ["mine"]


def test_save_into_a_regular_file_names_it_on_every_rank(world, tmp_path):
    (tmp_path / "afile").write_text("mine")
    outcomes = world.run(call_save, good_state, str(tmp_path / "afile"))
    assert_all_raise(outcomes, CheckpointingException, "afile is a regular file")
    assert (tmp_path / "afile").read_text() == "mine"


def test_load_rejects_overlapping_request_on_every_rank(world, saved):
    assert_all_raise(world.run(call_load, overlap_state, saved), ShardingIntegrityError, "overlap")


@pytest.mark.parametrize("strategy", [("nope", 1), ("torch_dist", 99)])
def test_save_with_unknown_backend_or_version_raises_naming_it(world, tmp_path, strategy):
    outcomes = world.run(call_save, good_state, str(tmp_path / "c"), {"sharded_strategy": strategy})
    assert_all_raise(
        outcomes, StrategyNotFoundError, f"backend={strategy[0]!r}, version={strategy[1]}"
    )
    assert "Registered:" in str(outcomes[0].error) and "torch_dist" in str(outcomes[0].error)


def _rewrite_config(ckpt: str, **fields: Any) -> None:
    """As if the checkpoint had been committed with these fields (its record sealed to
    match: an edited metadata.json alone is reported as damaged)."""
    path = os.path.join(ckpt, "metadata.json")
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    save_config(CheckpointingConfig(**config), ckpt)


@pytest.mark.parametrize(
    "fields",
    [{"sharded_backend": "nope"}, {"sharded_backend_version": 7}, {"common_backend_version": 3}],
)
def test_load_of_checkpoint_with_unknown_backend_or_version_raises(world, saved, fields):
    _rewrite_config(saved, **fields)
    outcomes = world.run(call_load, good_state, saved)
    assert_all_raise(outcomes, StrategyNotFoundError, str(list(fields.values())[0]))


def test_explicit_strategy_refuses_incompatible_version(world, saved):
    _rewrite_config(saved, sharded_backend_version=2)
    outcomes = world.run(
        call_load, good_state, saved, {"sharded_strategy": TorchDistLoadShardedStrategy()}
    )
    assert_all_raise(outcomes, IncompatibleCheckpointError, "version 2")


def test_load_of_directory_that_is_not_a_checkpoint_raises(world, tmp_path):
    assert_all_raise(
        world.run(call_load, good_state, str(tmp_path / "absent")),
        NotACheckpointError,
        "does not exist",
    )
    (tmp_path / "empty").mkdir()
    assert_all_raise(
        world.run(call_load, good_state, str(tmp_path / "empty")),
        NotACheckpointError,
        "no metadata.json",
    )


def test_checkpoint_without_metadata_json_is_not_loaded(world, saved):
    os.remove(os.path.join(saved, "metadata.json"))
    assert not dc.check_is_distributed_checkpoint(saved)
    assert_all_raise(
        world.run(call_load, good_state, saved), NotACheckpointError, "no metadata.json"
    )


def test_save_refuses_to_overwrite_complete_checkpoint(world, saved):
    before = sorted(os.listdir(saved))
    assert_all_raise(
        world.run(call_save, good_state, saved), CheckpointExistsError, "refusing to overwrite"
    )
    assert sorted(os.listdir(saved)) == before


def test_sharded_object_key_escaping_directory_raises_on_every_rank(world, tmp_path):
    with pytest.raises(CheckpointingException, match="'..'"):
        ShardedObject("../evil", 1, (1,), (0,))
    outcomes = world.run(call_save, escaping_object_state, str(tmp_path / "c"))
    assert_all_raise(outcomes, CheckpointingException, "failed on rank 1:")
    assert not (tmp_path / "outside").exists()


def test_failure_of_one_rank_during_write_raises_on_every_rank(world, tmp_path):
    outcomes = world.run(call_save, none_data_on_rank1_state, str(tmp_path / "c"))
    assert_all_raise(outcomes, CheckpointingException, "data is None")
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")
    world.run_ok(
        call_save, good_state, str(tmp_path / "c")
    )  # a retry into the same directory succeeds
    assert dc.check_is_distributed_checkpoint(tmp_path / "c")


def test_unexpected_key_under_assume_ok_raises_on_every_rank(world, saved):
    outcomes = world.run(call_load, request_with_unexpected_on_rank1, saved)
    assert_all_raise(outcomes, CheckpointingException, "'ghost'")


@pytest.mark.parametrize("strict", [StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL])
def test_unexpected_key_under_raising_modes_raises_on_every_rank(world, saved, strict):
    outcomes = world.run(call_load, request_with_unexpected_on_rank1, saved, {"strict": strict})
    assert_all_raise(outcomes, KeyMismatchError, "ghost")


def test_missing_keys_raise_under_raise_all(world, saved):
    outcomes = world.run(call_load, request_only_a, saved, {"strict": "raise_all"})
    assert_all_raise(outcomes, KeyMismatchError, "Missing keys")


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
    # a key that only one rank asks for is not missing: the check covers every rank's request
    results = world.run_ok(call_load, request_a_here_b_on_rank1, saved, {"strict": "return_all"})
    for _, missing, unexpected in results:
        assert missing == {"rng/shard_0_2", "rng/shard_1_2"} and unexpected == set()


def test_missing_data_file_raises_on_every_rank(world, saved):
    victim = next(f for f in sorted(os.listdir(saved)) if f.startswith("__1_"))
    os.remove(os.path.join(saved, victim))
    outcomes = world.run(call_load, good_state, saved)
    assert_all_raise(outcomes, CheckpointingException, "")
    assert any("file" in str(o.error) or "read" in str(o.error) for o in outcomes)


@pytest.mark.parametrize("returns_none,cause", [(False, "injected"), (True, "no common state")])
def test_common_state_failing_on_one_rank_raises_on_every_rank(world, saved, returns_none, cause):
    # the common state is loaded with the strategies' selection and agreed on in its exchange
    outcomes = world.run(load_with_common_failing_on_rank1, saved, returns_none)
    assert_all_raise(outcomes, CheckpointingException, "load of common state")
    assert all("rank 1" in str(o.error) and cause in str(o.error) for o in outcomes)


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


@pytest.mark.parametrize("victim", ["common.pt", "__0_0.distcp"])
def test_damage_is_named_relative_to_the_checkpoint_on_every_rank(world, saved, victim):
    path = os.path.join(saved, victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    outcomes = world.run(call_load, good_state, saved)
    assert_all_raise(outcomes, CheckpointCorruptedError, victim, "checksum mismatch")
    assert all(str(o.error).count(saved) == 1 for o in outcomes)  # in "load ... from <dir>"
    problems = [str(p) for p in verify_checkpoint(saved).problems]
    assert problems and all(p.startswith(victim) and saved not in p for p in problems)
