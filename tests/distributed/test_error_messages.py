"""Errors agreed across a 2-rank world group identical causes and name close keys."""

from __future__ import annotations

import time
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointingException, KeyMismatchError
from tests.distributed._rank_fns import (
    call_load,
    call_save,
    load_called_differently_on_rank1,
    save_validating_on_rank0_only,
)

pytestmark = pytest.mark.timeout(120)


def layer_state() -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    return {
        f"decoder.layers.{i}.mlp.weight": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.mlp.weight", torch.ones(2, 4), (0, r, w)
        )
        for i in range(3)
    }


def typo_request() -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    key = "decoder.layers.1.mlp.wieght"
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(2, 4), (0, r, w))}


def test_same_cause_on_both_ranks_is_reported_once_with_close_keys(world_factory, tmp_path):
    world = world_factory(2)
    world.run_ok(call_save, layer_state, str(tmp_path / "c"))
    outcomes = world.run(call_load, typo_request, str(tmp_path / "c"), {"strict": "raise_all"})
    for o in outcomes:
        assert isinstance(o.error, KeyMismatchError), o.trace
        message = str(o.error)
        assert message.startswith("Strict key check failed on ranks 0-1: KeyMismatchError:")
        assert message.count("Unexpected keys (for this rank") == 1  # not once per rank
        assert "'decoder.layers.1.mlp.wieght' (closest keys in the checkpoint: " in message
        assert "'decoder.layers.1.mlp.weight'" in message


@pytest.mark.parametrize("how", ["strategy", "validate"])
def test_ranks_loading_differently_raise_at_once_naming_each(world_factory, tmp_path, how):
    """Before, ranks loading with different strategies (or with and without the sharding
    check) waited in different collectives until the timeout; now the load's first
    reduction compares how each rank loads."""
    world = world_factory(2)
    world.run_ok(call_save, layer_state, str(tmp_path / "c"))
    start = time.monotonic()
    outcomes = world.run(load_called_differently_on_rank1, layer_state, str(tmp_path / "c"), how)
    assert time.monotonic() - start < 20
    for o in outcomes:
        assert isinstance(o.error, CheckpointingException), o.trace
        message = str(o.error)
        assert "the ranks were not called alike" in message and "rank 0:" in message, message
        assert "rank 1:" in message and "validate_access_integrity" in message, message
        if how == "strategy":
            assert "FullyParallelLoadStrategyWrapper" in message, message
    # called alike again, the same world loads
    loaded = world.run_ok(call_load, layer_state, str(tmp_path / "c"))
    assert all(len(sd) == 3 for sd in loaded)


def test_ranks_saving_with_and_without_validation_raise_at_once(world_factory, tmp_path):
    """Before, the validating rank compared the ranks' differing common states in a
    collective the other rank never joined; now the save's agreement compares the flags."""
    start = time.monotonic()
    results = world_factory(2).run_ok(save_validating_on_rank0_only, layer_state, str(tmp_path))
    assert time.monotonic() - start < 20
    for message, complete in results:
        assert message is not None and message.startswith("CheckpointingException"), message
        assert "validate_access_integrity=True" in message, message
        assert "validate_access_integrity=False" in message and not complete, message
