"""Reading ('local', 1) rank states (layout in docs/formats.md), so version-1 checkpoints load."""

from __future__ import annotations

import ast
from typing import Any

from .._types import ShardedStateDict
from ..mapping import ShardedObject, ShardedTensor
from ..tensor_aware_state_dict import MCoreTensorAwareStateDict

__all__ = ["is_v1_state", "v1_as_v2"]

_FORMAT = 1


def is_v1_state(state: Any) -> bool:
    """Whether a loaded local part is a version-1 rank state."""
    sd = getattr(state, "state_dict", None)
    return isinstance(sd, dict) and sd.get("format") == _FORMAT


def v1_as_v2(state: Any) -> MCoreTensorAwareStateDict:
    """A version-1 rank state as the version-2 state holding the same shards and objects.

    Version 1 stored every shard a rank held under `"<key> <global offset>"`, with its
    global and local shapes, and the ShardedObjects by unique key.
    """
    sd = state.state_dict
    sharded: ShardedStateDict = {}
    for name, entry in sd["sharded"].items():
        key, offset = name.rsplit(" (", 1)
        local, shape = tuple(entry["local_shape"]), tuple(entry["global_shape"])
        data = entry["data"].view(local)
        sharded[name] = ShardedTensor(
            key,
            data,
            data.dtype,
            local,
            shape,
            ast.literal_eval(f"({offset}"),
            None,
            prepend_axis_num=len(shape) - len(local),
        )
    for unique_key, value in sd["objects"].items():
        sharded[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        sharded[unique_key].data = value
    common = sd["common"] if isinstance(sd["common"], dict) else {}
    return MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)
