"""The 'torch' common strategy: common.pt, and ShardedObjects as files for backends that need it."""

from __future__ import annotations

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.dict_utils import dict_list_map_inplace
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.base import LoadShardedStrategy, SaveShardedStrategy


class TensorsOnlySave(SaveShardedStrategy):
    """A backend that stores only tensors: ShardedObjects go through the common strategy."""

    def save(self, sharded_state_dict, checkpoint_dir):
        tensors = {}
        for sh in dc.dict_utils.nested_values(sharded_state_dict):
            assert isinstance(sh, ShardedTensor), (
                "objects must have been routed to the common strategy"
            )
            tensors[sh.key] = sh.data
        torch.save(tensors, f"{checkpoint_dir}/tensors.pt")


class TensorsOnlyLoad(LoadShardedStrategy):
    def check_backend_compatibility(self, loaded_backend):
        pass

    def check_version_compatibility(self, loaded_version):
        pass

    def load(self, sharded_state_dict, checkpoint_dir):
        stored = torch.load(f"{checkpoint_dir}/tensors.pt")
        return dict_list_map_inplace(
            lambda sh: stored[sh.key] if isinstance(sh, ShardedTensor) else sh, sharded_state_dict
        )

    def load_tensors_metadata(self, checkpoint_dir):
        stored = torch.load(f"{checkpoint_dir}/tensors.pt")
        return {k: ShardedTensor.from_rank_offsets(k, v).without_data() for k, v in stored.items()}


def _state():
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(3.0)),
        "opt": [ShardedObject("optimizer/state", {"i": i}, (2,), (i,)) for i in range(2)],
    }


def test_sharded_objects_are_files_under_their_unique_key(tmp_path):
    dc.save(_state(), tmp_path / "c", sharded_strategy=TensorsOnlySave("tensors_only", 1))
    assert (tmp_path / "c" / "optimizer" / "state" / "shard_1_2.pt").is_file()
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(3)),
        "opt": [ShardedObject("optimizer/state", None, (2,), (i,)) for i in range(2)],
    }
    out = dc.load(request, tmp_path / "c", sharded_strategy=TensorsOnlyLoad())
    assert out["opt"] == [{"i": 0}, {"i": 1}] and torch.equal(out["w"], torch.arange(3.0))
    meta = dc.load_sharded_metadata(tmp_path / "c", sharded_strategy=TensorsOnlyLoad())
    assert {"optimizer/state/shard_0_2", "optimizer/state/shard_1_2", "w"} <= set(meta)


def test_object_file_paths_cannot_escape_the_checkpoint(tmp_path):
    sd = _state()
    sd["opt"][0].key = "../../escaped"  # bypassing construction-time validation
    with pytest.raises(CheckpointingException, match="escaped"):
        dc.save(sd, tmp_path / "c", sharded_strategy=TensorsOnlySave("tensors_only", 1))
    assert not list(tmp_path.rglob("shard_0_2.pt"))
