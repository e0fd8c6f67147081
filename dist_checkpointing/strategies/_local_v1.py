"""Reading ('local', 1) rank states (layout in docs/formats.md), so version-1 checkpoints load."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .. import _dist
from .._types import ShardedStateDict, StateDict
from ..dict_utils import dict_list_map_inplace
from ..errors import CheckpointingException
from ..mapping import ShardedObject, ShardedTensor

__all__ = ["is_v1_state", "v1_fill_request", "v1_sharded_metadata"]

_FORMAT = 1


def is_v1_state(state: Any) -> bool:
    """Whether a loaded local part is a version-1 rank state."""
    sd = getattr(state, "state_dict", None)
    return isinstance(sd, dict) and sd.get("format") == _FORMAT


def v1_sharded_metadata(state: Any) -> List[Any]:
    """`(key, dtype, global shape)` of a version-1 rank state's tensors, then its objects' keys."""
    sd = state.state_dict
    tensors = [
        (s.rsplit(" (", 1)[0], e["data"].dtype, e["global_shape"]) for s, e in sd["sharded"].items()
    ]
    return tensors + list(sd["objects"])


def v1_fill_request(request: ShardedStateDict, state: Any, where: str, hint: str) -> StateDict:
    """Replaces each requested leaf with its stored value (copied into `data` when given).

    Raises:
        CheckpointingException: a requested shard or object is absent or differs in shape
            or dtype (naming it, with `hint`).
    """
    sd: Dict[str, Any] = state.state_dict
    tensors: Dict[str, Any] = sd["sharded"]
    objects: Dict[str, Any] = sd["objects"]

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            entry = tensors.get(f"{leaf.key} {tuple(leaf.global_offset)}")
            if entry is None:
                raise CheckpointingException(
                    f"{where}: rank {_dist.get_rank()} saved no shard of {leaf.key!r} at offset "
                    f"{leaf.global_offset}. {hint}"
                )
            data: torch.Tensor = entry["data"]
            if (
                tuple(entry["global_shape"]) != tuple(leaf.global_shape)
                or tuple(entry["local_shape"]) != tuple(leaf.local_shape)
                or data.dtype != leaf.dtype
            ):
                raise CheckpointingException(
                    f"{where}: shard of {leaf.key!r} at {leaf.global_offset} was saved with global "
                    f"shape {tuple(entry['global_shape'])}, local shape "
                    f"{tuple(entry['local_shape'])}, dtype {data.dtype}; requested "
                    f"{tuple(leaf.global_shape)}, {tuple(leaf.local_shape)}, {leaf.dtype}. {hint}"
                )
            if leaf.data is not None:
                leaf.data.copy_(data.view(leaf.data.shape))
                return leaf.data
            return data.clone().view(leaf.local_shape)
        if isinstance(leaf, ShardedObject):
            if leaf.unique_key not in objects:
                raise CheckpointingException(
                    f"{where}: rank {_dist.get_rank()} saved no ShardedObject "
                    f"{leaf.unique_key!r}. {hint}"
                )
            return objects[leaf.unique_key]
        return leaf

    return dict_list_map_inplace(fill, request)
