"""Stand-ins for megatron-core's mapping classes (0.14-0.19 fields), without megatron.

Each class reports `megatron.core.dist_checkpointing.mapping` as its module, as megatron's
own do; that and the fields are all our recognition looks at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import torch

MODULE = "megatron.core.dist_checkpointing.mapping"


@dataclass
class ShardedTensor:
    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: Any = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    @classmethod
    def from_rank_offsets(cls, key, data, *rank_offsets, replica_id=0, prepend_axis_num=0):
        ndim = data.ndim + prepend_axis_num
        shape = [1] * prepend_axis_num + list(data.shape)
        offset, frag = [0] * ndim, [1] * ndim
        for axis, pos, n in rank_offsets:
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            shape[axis], offset[axis], frag[axis] = local * n, local * pos, n
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(shape),
            tuple(offset),
            tuple(frag),
            replica_id,
            prepend_axis_num,
        )


@dataclass
class ShardedObject:
    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: Any = 0


@dataclass
class ShardedTensorFactory:
    key: str
    data: torch.Tensor
    build_fn: Callable[..., Any]
    merge_fn: Callable[..., Any]
    replica_id: Any = 0
    flattened_range: Optional[slice] = None


class LocalNonpersistentObject:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


class ShardedTensorV99(ShardedTensor):
    """A class megatron might add one day: recognised as megatron's, not convertible."""


for _cls in (
    ShardedTensor,
    ShardedObject,
    ShardedTensorFactory,
    LocalNonpersistentObject,
    ShardedTensorV99,
):
    _cls.__module__ = MODULE


class LookAlike:
    """Not megatron's, not ours, but shaped like a sharded leaf (key, replica id, shape)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.data = torch.ones(2)
        self.replica_id = 0
        self.global_shape = (2,)
        self.global_offset = (0,)
