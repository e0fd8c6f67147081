"""Errors contain megatron-core's wording for the same case (users' scripts match on it).

Collected from megatron-core 0.16.1 `dist_checkpointing/serialization.py`,
`validation.py`, `strategies/base.py` and `strategies/common.py`; our messages keep their
own detail (keys, ranks, paths) and contain these phrases. Failures that involve ranks
are checked on 2 ranks: every rank raises a CheckpointingException holding the phrase.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.base import SaveShardedStrategy
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.validation import parse_strict_flag
from tests.distributed._failure_fns import (
    assert_all_raise,
    duplicate_object_state,
    good_state,
    missing_object_state,
    overlap_state,
    request_only_a,
    request_with_unexpected_on_rank1,
)
from tests.distributed._rank_fns import call_load, call_save

pytestmark = pytest.mark.timeout(180)


class _SyncOnly(SaveShardedStrategy):
    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        raise AssertionError("never called: the async save is refused first")


def test_missing_directory_says_checkpoint_directory_does_not_exist(world, tmp_path):
    missing = str(tmp_path / "nowhere")
    assert_all_raise(
        world.run(call_load, good_state, missing),
        CheckpointingException,
        f"Checkpoint directory {missing} does not exist",
    )


def test_directory_without_metadata_says_is_not_a_distributed_checkpoint(world, tmp_path):
    os.makedirs(tmp_path / "empty")
    assert_all_raise(
        world.run(call_load, good_state, str(tmp_path / "empty")),
        CheckpointingException,
        f"{tmp_path / 'empty'} is not a distributed checkpoint",
    )


def test_strict_missing_keys_say_missing_keys(world, saved):
    assert_all_raise(
        world.run(call_load, request_only_a, saved, {"strict": "raise_all"}),
        CheckpointingException,
        "Some keys found in the checkpoint are missing in the provided sharded state dict.",
        "Missing keys",
        "rng/shard_0_2",
    )


@pytest.mark.parametrize("strict", ["raise_unexpected", "raise_all"])
def test_strict_unexpected_keys_say_unexpected_keys(world, saved, strict):
    assert_all_raise(
        world.run(call_load, request_with_unexpected_on_rank1, saved, {"strict": strict}),
        CheckpointingException,
        "Unexpected keys (not found in the checkpoint) encountered in the provided sharded "
        "state dict.",
        "Unexpected keys",
        "ghost",
    )


def test_logged_key_mismatch_uses_the_same_phrases(tmp_path, caplog):
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    request = {"b": ShardedTensor.from_rank_offsets("b", torch.ones(2))}
    with caplog.at_level(logging.WARNING):
        dc.load(request, tmp_path / "c", strict="log_all")
    assert "Missing keys" in caplog.text and "Unexpected keys" in caplog.text


def test_unknown_backend_says_cannot_find_a_default_strategy(world, tmp_path):
    assert_all_raise(
        world.run(call_save, good_state, str(tmp_path / "c"), {"sharded_strategy": ("nope", 3)}),
        CheckpointingException,
        "Cannot find a default strategy for: ('save_sharded', 'nope', 3)",
    )


def test_async_save_with_sync_strategy_says_cannot_apply_async_save(tmp_path):
    with pytest.raises(CheckpointingException, match="Cannot apply async_save to non-async"):
        dc.save(
            {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))},
            tmp_path / "c",
            sharded_strategy=_SyncOnly("x", 1),
            async_sharded_save=True,
        )


def test_overlapping_shards_say_invalid_access_pattern(world, tmp_path):
    assert_all_raise(
        world.run(call_save, overlap_state, str(tmp_path / "c")),
        CheckpointingException,
        "Invalid access pattern for 'w'",
    )


def test_duplicate_objects_say_duplicate_sharded_object_keys(world, tmp_path):
    assert_all_raise(
        world.run(call_save, duplicate_object_state, str(tmp_path / "c")),
        CheckpointingException,
        "Duplicate ShardedObject keys",
        "obj/shard_0_2",
    )


def test_missing_object_pieces_say_sharded_object_are_missing(world, tmp_path):
    assert_all_raise(
        world.run(call_save, missing_object_state, str(tmp_path / "c")),
        CheckpointingException,
        "Invalid access pattern: 1 ShardedObject are missing",
    )


def test_missing_common_file_says_common_file_does_not_exist(tmp_path):
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)), "x": 1}, tmp_path / "c")
    os.remove(tmp_path / "c" / "common.pt")
    with pytest.raises(CheckpointingException, match="Common file .*common.pt does not exist"):
        dc.load_common_state_dict(tmp_path / "c")


def test_missing_object_file_says_object_shard_not_found(tmp_path):
    with pytest.raises(CheckpointingException, match="Object shard .*obj/shard_0_1.pt not found"):
        TorchCommonLoadStrategy().load_sharded_objects(
            {"o": ShardedObject("obj", None, (1,), (0,))}, tmp_path
        )


def test_shape_mismatch_says_global_shape_mismatch(tmp_path):
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    with pytest.raises(CheckpointingException, match="Global shape mismatch for 'a'"):
        dc.load({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3))}, tmp_path / "c")


def test_bad_strict_flag_says_invalid_strict_flag():
    with pytest.raises(ValueError, match="Invalid strict flag"):
        parse_strict_flag("sometimes")
