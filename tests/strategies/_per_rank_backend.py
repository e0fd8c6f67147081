"""A small user-defined backend, ('per_rank', 1), registered through the public registry.

Written only against public names (`strategies.base`, `mapping`, `errors`, `AsyncRequest`),
the way a user would write one: each rank `torch.save`s its main-replica shards to
`shards_<rank>.pt` (key, offset, shapes and data). Loading reads every rank's file and
hands each request the stored piece with the same key, offset and shape; it does not
reshard and says so. ShardedObjects and the common state go to the common strategy.
Failures are agreed on between ranks (an `all_gather_object` of error messages), so an
error on one rank raises on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from dist_checkpointing.errors import CheckpointingException, IncompatibleCheckpointError
from dist_checkpointing.mapping import ShardedTensor, is_main_replica
from dist_checkpointing.strategies.async_utils import AsyncRequest
from dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

BACKEND = "per_rank"
PREFIX = "shards_"
Slot = Tuple[str, Tuple[int, ...]]
CkptDir = Union[str, Path]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(error: Optional[BaseException], what: str) -> None:
    """Raises on every rank if `what` failed on any rank (names the ranks and causes)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = [mine]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
    failed = [(r, m) for r, m in enumerate(reports) if m is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise CheckpointingException(f"per_rank {what} failed on {detail}") from error


def _write(shards: Dict[Slot, Dict[str, Any]], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(shards, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PerRankSave(AsyncSaveShardedStrategy):
    """Saves this rank's main-replica shards to `shards_<rank>.pt` (sync or async)."""

    def _snapshot(self, sharded_state_dict: Any) -> Dict[Slot, Dict[str, Any]]:
        out: Dict[Slot, Dict[str, Any]] = {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
                assert sh.data is not None
                out[(sh.key, tuple(sh.global_offset))] = {
                    "global_shape": tuple(sh.global_shape),
                    "local_shape": tuple(sh.local_shape),
                    "data": sh.data.detach().to("cpu", copy=True),
                }
        return out

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: CkptDir) -> AsyncRequest:
        path = os.path.join(checkpoint_dir, f"{PREFIX}{_rank()}.pt")
        return AsyncRequest(_write, (self._snapshot(sharded_state_dict), path), [])

    def save(self, sharded_state_dict: Any, checkpoint_dir: CkptDir) -> None:
        error = None
        try:
            self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
        except Exception as e:  # agreed on below
            error = e
        _agree(error, f"save to {checkpoint_dir}")


class PerRankLoad(LoadShardedStrategy):
    """Loads ('per_rank', 1) checkpoints saved with the same sharding."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise IncompatibleCheckpointError(f"per_rank cannot read backend {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise IncompatibleCheckpointError(f"per_rank cannot read version {loaded_version}")

    def _stored(self, checkpoint_dir: CkptDir) -> Dict[Slot, Dict[str, Any]]:
        stored: Dict[Slot, Dict[str, Any]] = {}
        names = sorted(n for n in os.listdir(checkpoint_dir) if n.startswith(PREFIX))
        if not names:
            raise CheckpointingException(f"per_rank: no {PREFIX}*.pt files in {checkpoint_dir}")
        for name in names:
            stored.update(torch.load(os.path.join(checkpoint_dir, name), weights_only=True))
        return stored

    def load(self, sharded_state_dict: Any, checkpoint_dir: CkptDir) -> Any:
        error = None
        try:
            stored = self._stored(checkpoint_dir)

            def fill(sh: Any) -> Any:
                if not isinstance(sh, ShardedTensor):
                    return sh
                entry = stored.get((sh.key, tuple(sh.global_offset)))
                if entry is None or entry["local_shape"] != tuple(sh.local_shape):
                    raise CheckpointingException(
                        f"per_rank: no stored shard of {sh.key!r} at offset {sh.global_offset} "
                        f"with shape {sh.local_shape}; this backend does not reshard"
                    )
                data: torch.Tensor = entry["data"]
                if sh.data is None:
                    return data
                sh.data.copy_(data)
                return sh.data

            result = dict_list_map_inplace(fill, sharded_state_dict)
        except Exception as e:  # agreed on below
            error = e
        _agree(error, f"load from {checkpoint_dir}")
        return result

    def load_tensors_metadata(self, checkpoint_dir: CkptDir) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for (key, _), entry in self._stored(checkpoint_dir).items():
            shape = entry["global_shape"]
            out[key] = ShardedTensor(
                key, None, entry["data"].dtype, shape, shape, (0,) * len(shape), None
            )
        return out


def register() -> None:
    """Registers ('per_rank', 1) for SAVE_SHARDED and LOAD_SHARDED (idempotent)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, 1, PerRankSave(BACKEND, 1))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, 1, PerRankLoad())


def data_files(ckpt: str) -> List[str]:
    """The backend's data files in a checkpoint directory."""
    return sorted(n for n in os.listdir(ckpt) if n.startswith(PREFIX))
