"""The ('dcp', 1) common strategy: the common state of a checkpoint written by stock PyTorch
DCP (`torch.distributed.checkpoint.save`), which has no `common.pt`. Its non-tensor values
are DCP's byte items (`torch.save(value)` each, under the value's flat name); they are read
safely (`weights_only`, our allowlist) and nested again the way `.metadata`'s `planner_data`
records (flat names where it records none). Tensors are loaded by the torch_dist strategy.

A DCP checkpoint has no checksums: its first read in a process logs that once.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any, Dict

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ..._dcp_plain import unflatten
from ..._dist import get_rank
from ..._safe_load import torch_load
from ..._types import ShardedStateDict, StateDict
from ...errors import CheckpointingException
from ...seal import warn_unverified
from ..base import CheckpointDir, LoadCommonStrategy, require_backend, require_version
from .metadata_file import read_metadata
from .reader import read_byte_items

__all__ = ["DCP_COMMON_BACKEND", "DcpCommonLoadStrategy"]

logger = logging.getLogger(__name__)

DCP_COMMON_BACKEND = "dcp"


class DcpCommonLoadStrategy(LoadCommonStrategy):
    """Reads the non-tensor values of a stock DCP checkpoint as its common state.

    Args:
        weights_only: False allows arbitrary unpickling (trusted checkpoints only; else
            allowlist classes with `torch.serialization.add_safe_globals`).
    """

    can_handle_sharded_objects = True

    def __init__(self, weights_only: bool = True) -> None:
        self.weights_only = weights_only

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        require_backend(self, DCP_COMMON_BACKEND, loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        require_version(self, DCP_COMMON_BACKEND, (1,), loaded_version)

    def load_common(self, checkpoint_dir: CheckpointDir) -> StateDict:
        """The checkpoint's byte items, unpickled safely and nested by `planner_data`.

        Raises:
            CheckpointCorruptedError: a damaged `.metadata` or item.
            UnsafeCheckpointError: an item holds objects outside the safe allowlist.
        """
        ckpt = Path(checkpoint_dir)
        if get_rank() == 0:  # (once per directory and process, as the load's own check)
            warn_unverified(ckpt)
        metadata = read_metadata(ckpt)
        sdm = metadata.state_dict_metadata
        keys = sorted(k for k, v in sdm.items() if isinstance(v, BytesStorageMetadata))
        raw = read_byte_items(ckpt, metadata, [MetadataIndex(k) for k in keys])
        values: Dict[str, Any] = {}
        for key, data in zip(keys, raw):
            values[key] = torch_load(io.BytesIO(data), f"{key!r} in {ckpt}", self.weights_only)
        return unflatten(values, metadata.planner_data)

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Not used: the torch_dist strategy reads byte items itself.

        Raises:
            CheckpointingException: always.
        """
        raise CheckpointingException(
            f"{checkpoint_dir} was written by stock DCP: its objects are read by the "
            "torch_dist strategy"
        )
