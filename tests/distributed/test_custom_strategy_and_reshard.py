"""A user-registered backend round-trips through metadata.json; the README example reshards."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from dist_checkpointing.errors import CheckpointingException, IncompatibleCheckpointError
from dist_checkpointing.mapping import is_main_replica
from dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

pytestmark = pytest.mark.timeout(120)


class PerRankSave(SaveShardedStrategy):
    """Each rank torch.saves its main shards to shards_<rank>.pt (no resharding)."""

    def save(self, sharded_state_dict, checkpoint_dir):
        shards = {
            (sh.key, sh.global_offset): sh.data
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id)
        }
        torch.save(shards, os.path.join(checkpoint_dir, f"shards_{dist.get_rank()}.pt"))
        dist.barrier()


class PerRankLoad(LoadShardedStrategy):
    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != "per_rank":
            raise IncompatibleCheckpointError(f"per_rank cannot read {loaded_backend}")

    def check_version_compatibility(self, loaded_version):
        if loaded_version != 1:
            raise IncompatibleCheckpointError(f"per_rank cannot read version {loaded_version}")

    def load(self, sharded_state_dict, checkpoint_dir):
        shards: Dict[Any, torch.Tensor] = {}
        for name in os.listdir(checkpoint_dir):
            if name.startswith("shards_"):
                shards.update(torch.load(os.path.join(checkpoint_dir, name)))

        def fill(sh):
            if not isinstance(sh, ShardedTensor):
                return sh
            try:
                return shards[(sh.key, sh.global_offset)]
            except KeyError:
                raise CheckpointingException(
                    f"per_rank: no shard {sh.key!r} at {sh.global_offset}"
                ) from None

        return dict_list_map_inplace(fill, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir):
        return {}


def register_per_rank() -> None:
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "per_rank", 1, PerRankSave("per_rank", 1)
    )
    register_default_strategy(StrategyAction.LOAD_SHARDED, "per_rank", 1, PerRankLoad())


def state() -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), float(r)), (0, r, w)),
        "step": 11,
    }


def save_with_custom(ckpt: str) -> None:
    register_per_rank()
    dc.save(state(), ckpt, sharded_strategy=("per_rank", 1))


def load_registered(ckpt: str) -> Any:
    register_per_rank()
    sd = state()
    sd["w"].data.zero_()
    return dc.load(sd, ckpt)


def test_custom_backend_is_recorded_and_found_again_on_load(world_factory, tmp_path):
    world = world_factory(2)
    ckpt = str(tmp_path / "c")
    world.run_ok(save_with_custom, ckpt)
    with open(os.path.join(ckpt, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "per_rank"
    results = world.run_ok(load_registered, ckpt)
    for r, res in enumerate(results):
        assert torch.equal(res["w"], torch.full((2, 3), float(r))) and res["step"] == 11


def readme_save(ckpt: str) -> None:
    rank, w = dist.get_rank(), dist.get_world_size()
    full = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    local = full[:, rank * 4096 // w : (rank + 1) * 4096 // w].clone()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", local, (1, rank, w)), "step": 100}, ckpt)


def readme_load(ckpt: str) -> bool:
    rank, w2 = dist.get_rank(), dist.get_world_size()
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1024 // w2, 4096), (0, rank, w2))}
    state = dc.load(want, ckpt)
    full = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    return state["step"] == 100 and torch.equal(
        state["w"], full[rank * 1024 // w2 : (rank + 1) * 1024 // w2]
    )


def test_readme_example_reshards_columns_to_rows_across_world_sizes(world_factory, tmp_path):
    ckpt = str(tmp_path / "iter_100")
    world_factory(4).run_ok(readme_save, ckpt)
    assert world_factory(2).run_ok(readme_load, ckpt) == [True, True]
