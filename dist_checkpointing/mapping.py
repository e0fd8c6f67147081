"""The sharded state dict data model: nested dicts/lists whose leaves are `ShardedTensor`,
`ShardedObject`, `ShardedTensorFactory`, `LocalNonpersistentObject`, or anything else
("common" state, written once by rank 0). Classes validate their metadata at construction
(`_shard_checks`); pickled checkpoints and megatron's code name them by this module's path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Tuple, TypeVar, Union

import torch

from ._shard_checks import check_sharded_object, check_sharded_tensor, grid_of_rank_offsets
from ._types import ReplicaId, ShardedStateDict, StateDict
from .dict_utils import _merge_pairs, dict_list_map_inplace
from .errors import CheckpointingException

__all__ = [
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ShardedStateDict",
    "StateDict",
    "ReplicaId",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Whether `replica_id` marks the main replica (0, or all zeros): the copy that is saved."""
    return replica_id == 0 if isinstance(replica_id, int) else all(r == 0 for r in replica_id)


_Leaf = TypeVar("_Leaf", bound="ShardedBase")


class ShardedBase(ABC):
    """Common interface of every sharded leaf of a sharded state dict."""

    key: str
    data: object
    replica_id: ReplicaId

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Checks the metadata invariants; raises `CheckpointingException` when broken."""

    def without_data(self: _Leaf) -> _Leaf:
        """Returns a copy with `data=None` (metadata only, cheap to send between ranks)."""
        return replace(self, data=None)  # type: ignore[type-var]  # every leaf is a dataclass


@dataclass
class ShardedTensor(ShardedBase):
    """This rank's piece of a global tensor (construction raises `CheckpointingException` on
    metadata that is not a valid piece).

    Attributes:
        key: unique name of the global tensor.
        data: the local tensor, or None for metadata-only instances.
        dtype: dtype of the global tensor.
        local_shape: shape of `data` (without prepended axes).
        global_shape: shape of the global tensor (with prepended axes).
        global_offset: offset of `data` in the global tensor, one per global axis.
        axis_fragmentations: pieces along each global axis (regular grid), or None.
        replica_id: which copy of this piece this is; only main replicas are saved.
        prepend_axis_num: leading global axes of size 1 that `data` lacks.
        allow_shape_mismatch: on load, accept another global shape (the overlap is loaded,
            the rest is zeros; e.g. padded vocabularies).
        flattened_range: for a flat shard (megatron-core <= 0.13's distributed optimizer),
            the slice of the row-major flattened local piece that `data` holds.
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def validate_metadata_integrity(self) -> None:
        """Raises `CheckpointingException` unless this is a valid piece of the global tensor."""
        check_sharded_tensor(self)

    @property
    def prepended_local_shape(self) -> Tuple[int, ...]:
        """The local shape as it sits in the global tensor (prepended axes of size 1)."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    @property
    def has_regular_grid(self) -> bool:
        """Whether the tensor is split on a regular grid (axis_fragmentations is set)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """The index of this piece in the global tensor: ints on prepended axes, then slices."""
        prepended = tuple(self.global_offset[: self.prepend_axis_num])
        rest = tuple(
            slice(off, off + size)
            for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        )
        return prepended + rest

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """The position of this piece in the global grid of pieces (raises off a regular grid)."""
        out = list(self.global_offset[: self.prepend_axis_num])
        for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
            if size == 0 or off % size != 0:
                raise CheckpointingException(
                    f"{self.key!r} is not on a regular grid: offset {off}, local size {size}"
                )
            out.append(off // size)
        return tuple(out)

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Global size / fragmentation along each axis (raises off a regular grid or where an
        axis does not divide, unless `allow_shape_mismatch`)."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"{self.key!r} has no axis_fragmentations")
        out = []
        for axis_size, fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_size % fragm != 0:
                raise CheckpointingException(
                    f"Axis size {axis_size} of {self.key!r} is not divisible by its "
                    f"fragmentation {fragm}"
                )
            out.append(axis_size // fragm)
        return tuple(out)

    def init_data(
        self, device: Union[str, torch.device], init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocates `data` with `init_fn(local_shape, dtype=..., device=...)` if it is None
        (for a flat shard, the `flattened_range` slice of it)."""
        if self.data is None:
            data = init_fn(self.local_shape, dtype=self.dtype, device=device)
            if self.flattened_range is not None:
                data = data.flatten()[self.flattened_range.start : self.flattened_range.stop]
            self.data = data

    def narrow(self, dim: int, start: int, length: int) -> List[ShardedTensor]:
        """`torch.narrow` of the local tensor on local axis `dim` (every rank alike, so the
        global tensor shrinks in proportion); a one-element list. Raises
        `CheckpointingException` off a regular grid along `dim`."""
        if self.data is None:
            raise CheckpointingException(f"Cannot narrow {self.key!r} without data")
        if self.flattened_range is not None:
            raise CheckpointingException(f"Cannot narrow the flat shard of {self.key!r}")
        gdim = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        glob, off = self.global_shape[gdim], self.global_offset[gdim]
        if local == 0 or glob % local or off % local:
            raise CheckpointingException(
                f"narrow of {self.key!r} needs a regular grid on axis {dim}: global {glob}, "
                f"offset {off}, local {local}"
            )
        data = self.data.narrow(dim, start, length)
        shape, offset = list(self.global_shape), list(self.global_offset)
        shape[gdim], offset[gdim] = glob // local * length, off // local * length
        return [
            replace(
                self,
                data=data,
                local_shape=tuple(data.shape),
                global_shape=tuple(shape),
                global_offset=tuple(offset),
            )
        ]

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Builds a ShardedTensor on a regular grid from per-axis rank positions.

        Args:
            key, data: the global tensor's name and the local tensor.
            *rank_offsets: `(axis, axis_rank_offset, axis_fragmentations)`: along global
                `axis`, `data` is piece `axis_rank_offset` of `axis_fragmentations` equal ones.
            replica_id, prepend_axis_num, allow_shape_mismatch: see `ShardedTensor`.
            flattened_range: must be None (flat shards: `from_rank_offsets_flat`).

        Raises:
            CheckpointingException: an invalid or repeated axis, or a position out of range.
        """
        if flattened_range is not None:
            raise CheckpointingException(
                f"Cannot instantiate a flat ShardedTensor {key!r} with `from_rank_offsets`; "
                "use `from_rank_offsets_flat`"
            )
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"data of {key!r} must be a torch.Tensor")
        local = tuple(data.shape)
        grid = grid_of_rank_offsets(key, local, prepend_axis_num, rank_offsets)
        return cls(
            key, data, data.dtype, local, *grid, replica_id, prepend_axis_num, allow_shape_mismatch
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Builds a flat shard (megatron-core <= 0.13): `data`, 1-D, is the `flattened_range`
        (required) of this rank's flattened grid piece of shape `non_flat_local_shape`,
        placed by `rank_offsets` as in `from_rank_offsets`.

        Raises:
            CheckpointingException: without `flattened_range`, on data that is not 1-D of
                the range's length, or on invalid rank offsets.
        """
        if flattened_range is None:
            raise CheckpointingException(
                f"Cannot instantiate a non-flat ShardedTensor {key!r} with "
                "`from_rank_offsets_flat`; use `from_rank_offsets`"
            )
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"data of {key!r} must be a torch.Tensor")
        local = tuple(non_flat_local_shape)
        grid = grid_of_rank_offsets(key, local, prepend_axis_num, rank_offsets)
        meta = (replica_id, prepend_axis_num, allow_shape_mismatch)
        return cls(key, data, data.dtype, local, *grid, *meta, flattened_range)

    def __str__(self) -> str:
        flat = "" if self.flattened_range is None else f", flattened_range={self.flattened_range}"
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local={self.local_shape}, "
            f"global={self.global_shape}, offset={self.global_offset}, "
            f"replica_id={self.replica_id}{flat})"
        )


@dataclass
class ShardedObject(ShardedBase):
    """This rank's piece of a global grid of picklable objects (not reshardable;
    construction raises `CheckpointingException` on an unsafe key or inconsistent metadata).

    Attributes:
        key: name of the global object; a safe relative path ('/'-separated, no '..').
        data: the local object, or None for metadata-only instances.
        global_shape, global_offset: shape of the grid of pieces; this piece's position.
        replica_id: which copy this is; only main replicas are saved.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def validate_metadata_integrity(self) -> None:
        """Raises `CheckpointingException` on an unsafe key or an offset outside the grid."""
        check_sharded_object(self)

    @property
    def unique_key(self) -> str:
        """`<key>/shard_<offset>_<shape>`, dot-separated: the name of this piece on disk."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Parses a `unique_key` back into a metadata-only ShardedObject (raises
        `CheckpointingException` if it is not `<key>/shard_<offset>_<shape>`)."""
        try:
            key, shard = unique_key.rsplit("/", 1)
            tag, offset_s, shape_s = shard.split("_")
            if tag != "shard":
                raise ValueError("missing 'shard' tag")
            offset = tuple(int(v) for v in offset_s.split("."))
            shape = tuple(int(v) for v in shape_s.split("."))
        except ValueError as e:
            raise CheckpointingException(
                f"Malformed ShardedObject unique key {unique_key!r}: {e}"
            ) from e
        return cls(key, None, shape, offset, replica_id)

    def __str__(self) -> str:
        return f"ShardedObject(key={self.unique_key!r}, replica_id={self.replica_id})"


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor that expands into a sub-state-dict for saving and is merged back after load.

    `build_fn(key, data, replica_id, flattened_range)` returns the sub-state-dict to save;
    `merge_fn(loaded_sub_state_dict)` returns the tensor.
    """

    key: str
    data: Optional[torch.Tensor]
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        """Builds the sub-state-dict from the original tensor."""
        if self.data is None:
            raise CheckpointingException(f"Cannot build factory {self.key!r} without data")
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Factories carry no shard geometry of their own; nothing to check."""


class LocalNonpersistentObject:
    """Wraps a value that is not saved; on load the local value is put back in its place."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """Returns the wrapped value."""
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces every `ShardedTensorFactory` by the sub-state-dict it builds, in place."""
    dict_list_map_inplace(
        lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict
    )


def apply_factory_merges(x1: Any, x2: Any, key: Tuple[Any, ...] = ()) -> Any:
    """Merges the loaded sub-state-dicts in `x1` (in place; returned) back into tensors,
    following the factories in `x2`, a tree shaped like (part of) `x1`; `key` is the key
    path of `x1`, for messages. Raises `CheckpointingException` if the trees do not line up."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    for k, v2 in _merge_pairs(x1, x2, key, CheckpointingException):
        if isinstance(x1, dict) and k not in x1:
            raise CheckpointingException(
                f"Factory key {key + (k,)} is missing from the loaded state dict"
            )
        x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    return x1
