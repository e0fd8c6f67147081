"""A custom storage backend, registered by name and version, found again on load.

    torchrun --standalone --nproc-per-node 2 examples/custom_strategy.py [CKPT_ROOT]

The "per_rank" backend writes each rank's main shards to its own `shards_<rank>.pt` (no
resharding: load with the layout you saved). `save(..., sharded_strategy=("per_rank", 1))`
records the backend in `metadata.json`; `load` reads that record and asks the registry
for the matching load strategy, so every process that loads must register it first.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from dist_checkpointing.errors import CheckpointingException, IncompatibleCheckpointError
from dist_checkpointing.mapping import is_main_replica
from dist_checkpointing.strategies.base import (
    CheckpointDir,
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)


class PerRankSave(SaveShardedStrategy):
    """Each rank `torch.save`s its main shards to `shards_<rank>.pt`."""

    def save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        shards = {
            (sh.key, sh.global_offset): sh.data
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id)
        }
        torch.save(shards, Path(checkpoint_dir) / f"shards_{dist.get_rank()}.pt")
        dist.barrier()  # the library commits metadata.json after every rank returned


class PerRankLoad(LoadShardedStrategy):
    """Reads every `shards_*.pt` and hands each rank the shards it asks for."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "per_rank":
            raise IncompatibleCheckpointError(f"per_rank cannot read {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise IncompatibleCheckpointError(f"per_rank cannot read version {loaded_version}")

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> Any:
        shards: Dict[Any, torch.Tensor] = {}
        for path in sorted(Path(checkpoint_dir).glob("shards_*.pt")):
            shards.update(torch.load(path, weights_only=True))

        def fill(sh: Any) -> Any:
            if not isinstance(sh, ShardedTensor):
                return sh
            if (sh.key, sh.global_offset) not in shards:
                raise CheckpointingException(f"per_rank: no shard {sh.key!r} at {sh.global_offset}")
            return shards[(sh.key, sh.global_offset)]

        return dict_list_map_inplace(fill, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        return {}  # this simple backend keeps no tensor metadata


def register_per_rank() -> None:
    """Registers both directions of ('per_rank', 1); call it in every process, before use."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "per_rank", 1, PerRankSave("per_rank", 1)
    )
    register_default_strategy(StrategyAction.LOAD_SHARDED, "per_rank", 1, PerRankLoad())


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = output_dir("custom") / "iter_0000001"
    if rank == 0 and ckpt.exists():
        shutil.rmtree(ckpt)  # save() never overwrites a complete checkpoint
    dist.barrier()
    register_per_rank()

    def state() -> Dict[str, Any]:
        w = torch.full((2, 3), float(rank))
        return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)), "step": 11}

    dc.save(state(), ckpt, sharded_strategy=("per_rank", 1))
    request = state()
    request["w"].data.zero_()
    loaded = dc.load(request, ckpt)  # metadata.json says per_rank, version 1
    assert torch.equal(loaded["w"], torch.full((2, 3), float(rank))) and loaded["step"] == 11
    if rank == 0:
        print(f"saved and loaded {ckpt} with the per_rank backend: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
