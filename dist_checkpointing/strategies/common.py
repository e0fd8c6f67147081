"""The 'torch' common strategy, version 1: rank 0 writes `common.pt`; ShardedObjects (for
sharded backends that don't store them) go to `<ckpt>/<key>/shard_<offset>_<shape>.pt`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch

from .._dist import get_rank
from .._safe_load import torch_load
from .._shard_checks import safe_join
from .._types import ShardedStateDict, StateDict
from ..dict_utils import dict_list_map_inplace, nested_values
from ..errors import CheckpointCorruptedError, CheckpointingException
from ..integrity import read_checksums
from ..mapping import ShardedObject, is_main_replica
from ..storage import objstore
from ..storage.fileio import atomic_write, open_read
from .base import (
    CheckpointDir,
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
    require_backend,
    require_version,
)

__all__ = [
    "COMMON_STATE_FNAME",
    "TorchCommonSaveStrategy",
    "TorchCommonLoadStrategy",
    "register_default_common_strategies",
]

COMMON_STATE_FNAME = "common.pt"
#: megatron-core >= 0.17 stores the common state as this ShardedObject in the DCP files.
MCORE_COMMON_STATE_KEY = "common_state"
DCP_METADATA_FNAME = ".metadata"
BACKEND = "torch"
SUPPORTED_VERSIONS = (1,)


def register_default_common_strategies() -> None:
    """Registers ('torch', 1) for SAVE_COMMON and LOAD_COMMON."""
    register_default_strategy(StrategyAction.LOAD_COMMON, BACKEND, 1, TorchCommonLoadStrategy())
    register_default_strategy(
        StrategyAction.SAVE_COMMON, BACKEND, 1, TorchCommonSaveStrategy(BACKEND, 1)
    )


def write_bytes_atomically(payload: bytes, path: str) -> None:
    """Writes `payload` to `path` durably and atomically (runs in background writers)."""
    atomic_write(Path(path), lambda f: f.write(payload))


def _torch_save_atomic(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes `common.pt` (rank 0) and ShardedObjects as per-object `.pt` files."""

    can_handle_sharded_objects = True

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir) -> None:
        """Rank 0 writes `common_state_dict` to `<checkpoint_dir>/common.pt`, atomically."""
        if get_rank() == 0:
            _torch_save_atomic(common_state_dict, Path(checkpoint_dir) / COMMON_STATE_FNAME)

    def deferred_save_common(
        self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir
    ) -> Optional[List[Tuple[Callable[..., Any], Tuple[Any, ...]]]]:
        """Rank 0 serializes the common state now; the background writer writes the bytes."""
        if get_rank() != 0:
            return []
        buf = io.BytesIO()
        torch.save(common_state_dict, buf)
        path = str(Path(checkpoint_dir) / COMMON_STATE_FNAME)
        return [(write_bytes_atomically, (buf.getvalue(), path))]

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> None:
        """Writes each main-replica ShardedObject to `<checkpoint_dir>/<unique_key>.pt`."""
        for sh_obj in nested_values(sharded_objects_state_dict):
            if isinstance(sh_obj, ShardedObject) and is_main_replica(sh_obj.replica_id):
                path = safe_join(checkpoint_dir, sh_obj.unique_key, ".pt")
                path.parent.mkdir(parents=True, exist_ok=True)
                _torch_save_atomic(sh_obj.data, path)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads `common.pt` and per-object `.pt` files.

    Args:
        weights_only: False allows arbitrary unpickling (trusted checkpoints only; else
            allowlist classes with `torch.serialization.add_safe_globals`).
        verify_checksums: check `common.pt` against `checksums.json` when it records one.
    """

    can_handle_sharded_objects = True

    def __init__(self, weights_only: bool = True, verify_checksums: bool = True) -> None:
        self.weights_only = weights_only
        self.verify_checksums = verify_checksums

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        require_backend(self, BACKEND, loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        require_version(self, BACKEND, SUPPORTED_VERSIONS, loaded_version)

    def load_common(self, checkpoint_dir: CheckpointDir) -> StateDict:
        """Loads `common.pt` (without it, megatron-core >= 0.17's `common_state` in the DCP files).

        Raises:
            CheckpointCorruptedError: missing, malformed, failing verification, or not a dict.
            UnsafeCheckpointError: if it holds objects outside the safe allowlist.
        """
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not objstore.is_file(path):
            if objstore.is_file(Path(checkpoint_dir) / DCP_METADATA_FNAME):
                return self._load_common_from_dcp(Path(checkpoint_dir))
            raise CheckpointCorruptedError(f"Common file {path} does not exist")  # megatron's words
        sums = read_checksums(checkpoint_dir) if self.verify_checksums else None
        if sums is None or COMMON_STATE_FNAME not in sums.files:
            with open_read(path) as f:
                state = torch_load(f, str(path), self.weights_only)  # type: ignore[arg-type]
        else:
            try:
                with open_read(path) as f:
                    raw = f.read()
            except OSError as e:
                raise CheckpointCorruptedError(f"{path}: cannot be read ({e})") from e
            sums.verify_file(COMMON_STATE_FNAME, raw, str(path))
            state = torch_load(io.BytesIO(raw), str(path), self.weights_only)
        if not isinstance(state, dict):
            raise CheckpointCorruptedError(f"{path}: expected a dict, got {type(state).__name__}")
        return state

    def _load_common_from_dcp(self, ckpt: Path) -> StateDict:
        """The common state as megatron-core >= 0.17 stores it: ShardedObject `common_state`."""
        from .torch_dist.load import TorchDistLoadShardedStrategy  # the files are DCP's

        request = {"common": ShardedObject(MCORE_COMMON_STATE_KEY, None, (1,), (0,))}
        dcp = TorchDistLoadShardedStrategy(
            weights_only=self.weights_only, verify_checksums=self.verify_checksums
        )
        try:  # not collective: this rank plans and reads on its own
            state = dcp._read(request, ckpt, dcp._plan(request, ckpt))[0]["common"]
        except CheckpointCorruptedError:
            raise
        except CheckpointingException as e:
            raise CheckpointCorruptedError(
                f"Common file {ckpt / COMMON_STATE_FNAME} does not exist, and no ShardedObject "
                f"{MCORE_COMMON_STATE_KEY!r} is in its DCP files ({e})"
            ) from e
        if not isinstance(state, dict):
            raise CheckpointCorruptedError(
                f"{ckpt}: common state {MCORE_COMMON_STATE_KEY!r} is a {type(state).__name__}, "
                "not a dict"
            )
        return state

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Replaces each ShardedObject leaf with the object loaded from its file, in place."""

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedObject):
                return x
            path = safe_join(checkpoint_dir, x.unique_key, ".pt")
            if not Path(path).is_file():  # megatron-core's wording for this case
                raise CheckpointCorruptedError(f"Object shard {path} not found")
            return torch_load(path, f"ShardedObject {x.unique_key!r} ({path})", self.weights_only)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Lists the ShardedObjects stored as files, keyed by unique key."""
        root = Path(checkpoint_dir)
        out: ShardedStateDict = {}
        for path in sorted(root.rglob("shard_*.pt")):
            rel = path.relative_to(root).with_suffix("")
            if len(rel.parts) >= 2:
                sh_obj = ShardedObject.empty_from_unique_key(rel.as_posix())
                out[sh_obj.unique_key] = sh_obj
        return out
