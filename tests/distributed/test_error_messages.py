"""Errors agreed across a 2-rank world group identical causes and name close keys."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import KeyMismatchError
from tests.distributed._rank_fns import call_load, call_save

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
