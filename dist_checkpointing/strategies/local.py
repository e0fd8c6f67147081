"""The ('local', 1) backend: each rank's whole state on node-local storage, replicated.

`dc.save(sharded_sd, ckpt_dir, sharded_strategy=('local', 1))` stores each rank's sharded
leaves (replicas included: no deduplication) and its common state as one local checkpoint
part, `<ckpt_dir>/<rank>/iter_0000000_<rank>_local.pt`, through `LocalCheckpointManager`,
with copies on other ranks when the strategy is built with a replication strategy.
`ckpt_dir` need not be shared between ranks: every rank writes its own `metadata.json`.

`dc.load(sharded_sd, ckpt_dir)` gives every rank back its own part, fetching it from a
replica holder when its node lost it. The layout must be the saved one (same world size,
same shards): the backend does not reshard; save with ('torch_dist', 1) for that.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _dist
from .._types import ShardedStateDict, StateDict
from ..async_save import AsyncRequest
from ..dict_utils import dict_list_map_inplace, nested_values
from ..errors import CheckpointingException, IncompatibleCheckpointError
from ..local.basic_state_dict import BasicTensorAwareStateDict
from ..local.ckpt_managers.local_manager import LocalCheckpointManager
from ..local.replication.strategies import ReplicationStrategy
from ..mapping import ShardedObject, ShardedTensor
from .base import (
    CheckpointDir,
    NodeLocalLoadShardedStrategy,
    NodeLocalSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
    require_backend,
    require_version,
)

__all__ = [
    "LocalSaveShardedStrategy",
    "LocalLoadShardedStrategy",
    "register_default_local_strategies",
]

logger = logging.getLogger(__name__)

BACKEND = "local"
SUPPORTED_VERSIONS = (1,)
_ITERATION = 0
_FORMAT = 1
_RESHARD_HINT = (
    "The 'local' backend restores exactly the layout it saved; to change world size or "
    "sharding, save with the ('torch_dist', 1) backend, which reshards on load"
)


def register_default_local_strategies() -> None:
    """Registers ('local', 1) for SAVE_SHARDED and LOAD_SHARDED (no replication by default)."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, 1, LocalLoadShardedStrategy())
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, 1, LocalSaveShardedStrategy(BACKEND, 1)
    )


def _tensor_slot(key: str, global_offset: Tuple[int, ...]) -> str:
    return f"{key} {tuple(global_offset)}"


class LocalSaveShardedStrategy(NodeLocalSaveShardedStrategy):
    """Saves each rank's whole state as a local checkpoint part.

    Args:
        backend: recorded in `metadata.json` ('local').
        version: recorded in `metadata.json` (1).
        repl_strategy: where copies go, e.g.
            `CliqueReplicationStrategy.from_replication_params(replication_jump=8)`;
            None keeps each part on its own node only.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = 1,
        repl_strategy: Optional[ReplicationStrategy] = None,
    ) -> None:
        super().__init__(backend, version)
        self.repl_strategy = repl_strategy

    def _rank_state(
        self, sharded_state_dict: ShardedStateDict, common_state_dict: StateDict
    ) -> BasicTensorAwareStateDict:
        tensors: Dict[str, Any] = {}
        objects: Dict[str, Any] = {}
        for sh in (
            nested_values(sharded_state_dict)
            if isinstance(sharded_state_dict, (dict, list))
            else []
        ):
            if isinstance(sh, ShardedTensor):
                if sh.data is None:
                    raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
                slot = _tensor_slot(sh.key, sh.global_offset)
                if slot in tensors:
                    raise CheckpointingException(
                        f"ShardedTensor {sh.key!r} at offset {sh.global_offset} appears twice on rank {_dist.get_rank()}"
                    )
                tensors[slot] = {
                    "global_shape": tuple(sh.global_shape),
                    "local_shape": tuple(sh.local_shape),
                    "data": sh.data,
                }
            elif isinstance(sh, ShardedObject):
                objects[sh.unique_key] = sh.data
        return BasicTensorAwareStateDict(
            {
                "format": _FORMAT,
                "world_size": _dist.get_world_size(),
                "common": common_state_dict,
                "sharded": tensors,
                "objects": objects,
            }
        )

    def _manager(self, checkpoint_dir: CheckpointDir) -> LocalCheckpointManager:
        manager = LocalCheckpointManager(checkpoint_dir, "", self.repl_strategy)
        # parts left by an earlier, uncommitted save into this directory
        manager._cleanup_failed_save(_ITERATION)
        return manager

    def async_save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> AsyncRequest:
        state = self._rank_state(sharded_state_dict, common_state_dict)
        request = self._manager(checkpoint_dir).save(state, _ITERATION, is_async=True)
        assert request is not None
        return request

    def save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> None:
        state = self._rank_state(sharded_state_dict, common_state_dict)
        self._manager(checkpoint_dir).save(state, _ITERATION)


class LocalLoadShardedStrategy(NodeLocalLoadShardedStrategy):
    """Loads ('local', 1) checkpoints; a rank whose node lost its part gets it from a holder.

    Args:
        weights_only: keep True to refuse arbitrary pickled objects in the non-tensor state;
            False only for trusted checkpoints.
    """

    def __init__(self, weights_only: bool = True) -> None:
        self.weights_only = weights_only

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        require_backend(self, BACKEND, loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        require_version(self, BACKEND, SUPPORTED_VERSIONS, loaded_version)

    def _manager(self, checkpoint_dir: CheckpointDir) -> LocalCheckpointManager:
        manager = LocalCheckpointManager(checkpoint_dir, "", None, use_replicas=True)
        manager.weights_only = self.weights_only
        return manager

    def _read_state(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        """Collective: this rank's stored state (fetched from a holder if needed)."""
        manager = self._manager(checkpoint_dir)
        if manager.find_latest() != _ITERATION:
            raise IncompatibleCheckpointError(
                f"{checkpoint_dir}: the local parts found do not cover all {_dist.get_world_size()} "
                f"ranks of this job (lost without a replica, or saved with another world size). "
                f"{_RESHARD_HINT}"
            )
        state, _ = manager.load()
        return self._checked(state, checkpoint_dir)

    def _checked(self, state: Any, where: Any) -> Dict[str, Any]:
        sd = getattr(state, "state_dict", None)
        if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
            raise CheckpointingException(f"{where}: not a ('local', 1) rank state")
        world = _dist.get_world_size()
        if sd.get("world_size") != world:
            raise IncompatibleCheckpointError(
                f"{where} was saved by {sd.get('world_size')} ranks, loading with {world}. {_RESHARD_HINT}"
            )
        return sd

    def load_rank_state(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> Tuple[StateDict, StateDict]:
        stored = self._read_state(checkpoint_dir)
        result = _dist.run_collectively(
            f"local checkpoint load from {checkpoint_dir}",
            _fill_request,
            sharded_state_dict,
            stored,
            str(checkpoint_dir),
        )
        common = stored["common"]
        return (common if isinstance(common, dict) else {}), result

    def _own_state(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        """This rank's own stored state, read from its own directory (not collective)."""
        manager = self._manager(checkpoint_dir)
        return self._checked(manager._load((_ITERATION, _dist.get_rank(), "")), checkpoint_dir)

    def load_common_rank_state(self, checkpoint_dir: CheckpointDir) -> StateDict:
        common = self._own_state(checkpoint_dir)["common"]
        return common if isinstance(common, dict) else {}

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """The tensors of this rank's own part (whole-tensor metadata, no data)."""
        return _tensors_metadata(self._own_state(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        sd = self._own_state(checkpoint_dir)
        out = _tensors_metadata(sd)
        for unique_key in sd["objects"]:
            obj = ShardedObject.empty_from_unique_key(unique_key)
            out[obj.unique_key] = obj
        return out


def _tensors_metadata(sd: Dict[str, Any]) -> ShardedStateDict:
    out: ShardedStateDict = {}
    for slot, entry in sd["sharded"].items():
        key = slot.rsplit(" (", 1)[0]
        shape = tuple(entry["global_shape"])
        out[key] = ShardedTensor(
            key, None, entry["data"].dtype, shape, shape, (0,) * len(shape), None
        )
    return out


def _fill_request(request: ShardedStateDict, stored: Dict[str, Any], where: str) -> StateDict:
    """Replaces each requested leaf with its stored value (copied into `data` when given)."""
    tensors: Dict[str, Any] = stored["sharded"]
    objects: Dict[str, Any] = stored["objects"]

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            entry = tensors.get(_tensor_slot(leaf.key, leaf.global_offset))
            if entry is None:
                raise CheckpointingException(
                    f"{where}: rank {_dist.get_rank()} saved no shard of {leaf.key!r} at offset "
                    f"{leaf.global_offset}. {_RESHARD_HINT}"
                )
            data: torch.Tensor = entry["data"]
            if (
                tuple(entry["global_shape"]) != tuple(leaf.global_shape)
                or tuple(entry["local_shape"]) != tuple(leaf.local_shape)
                or data.dtype != leaf.dtype
            ):
                raise CheckpointingException(
                    f"{where}: shard of {leaf.key!r} at {leaf.global_offset} was saved with global shape "
                    f"{tuple(entry['global_shape'])}, local shape {tuple(entry['local_shape'])}, dtype "
                    f"{data.dtype}; requested {tuple(leaf.global_shape)}, {tuple(leaf.local_shape)}, "
                    f"{leaf.dtype}. {_RESHARD_HINT}"
                )
            if leaf.data is not None:
                leaf.data.copy_(data.view(leaf.data.shape))
                return leaf.data
            return data.clone().view(leaf.local_shape)
        if isinstance(leaf, ShardedObject):
            if leaf.unique_key not in objects:
                raise CheckpointingException(
                    f"{where}: rank {_dist.get_rank()} saved no ShardedObject {leaf.unique_key!r}. {_RESHARD_HINT}"
                )
            return objects[leaf.unique_key]
        return leaf

    return dict_list_map_inplace(fill, request)
