"""The local backend's versions: ('local', 2) on MCoreTensorAwareStateDict, ('local', 1) read.

`data/local_v1` was written by the version-1 code (see `data/README.md`).
"""

from __future__ import annotations

import json
import os

import pytest

from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
from dist_checkpointing.strategies.local import LocalSaveShardedStrategy

from . import _local_fns as F

pytestmark = pytest.mark.timeout(300)


def _values(world, fn, *args):
    return world.run_ok(fn, *args, timeout=180)


def test_version_1_checkpoint_still_loads(world_factory, tmp_path):
    world = world_factory(2)
    assert _values(world, F.load_v1_fixture, str(tmp_path)) == [True, True]


def test_new_saves_record_version_2(world_factory, tmp_path):
    world = world_factory(2)
    _values(world, F.dc_save, str(tmp_path), 1, 1, False)
    with open(os.path.join(tmp_path, "node0", "ckpt", "metadata.json")) as f:
        meta = json.load(f)
    assert (meta["sharded_backend"], meta["sharded_backend_version"]) == ("local", 2)
    assert _values(world, F.dc_load_in_place, str(tmp_path)) == [True, True]


@pytest.mark.parametrize("factor", [1, 2])
def test_fully_parallel_stores_each_replicated_shard_once(world_factory, tmp_path, factor):
    world = world_factory(2)
    stored = _values(world, F.dc_save_fully_parallel, str(tmp_path), factor)
    # 'w' is split (each rank stores its own); 'bias' is replicated: exactly one rank stores it
    assert all(s["w"] == 16 * 8 for s in stored)
    assert sum("bias" in s for s in stored) == 1
    assert _values(world, F.dc_load, str(tmp_path)) == [True, True]


def test_version_1_is_not_written_and_both_versions_load():
    with pytest.raises(CheckpointingException, match="version 1 checkpoints are still loaded"):
        LocalSaveShardedStrategy("local", 1)
    with pytest.raises(CheckpointingException, match="algo"):
        LocalSaveShardedStrategy("local", 2, algo="nope")
    for version in (1, 2):
        get_default_strategy(StrategyAction.LOAD_SHARDED, "local", version)
    get_default_strategy(StrategyAction.SAVE_SHARDED, "local", 2)
