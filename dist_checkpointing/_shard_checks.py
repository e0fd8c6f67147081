"""Invariant checks run when a `ShardedTensor` or `ShardedObject` is built; each raises
`CheckpointingException` naming the key and the broken invariant. Keys become paths only
through `safe_join`, which refuses anything outside the checkpoint, and a save's separation
hint only as a plain file-name prefix (`check_separation_hint`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import torch

from ._types import ReplicaId
from .errors import CheckpointingException

if TYPE_CHECKING:
    from .mapping import ShardedObject, ShardedTensor

__all__ = [
    "as_int_tuple",
    "check_key_is_safe_relative_path",
    "check_separation_hint",
    "check_replica_id",
    "check_sharded_object",
    "check_sharded_tensor",
    "grid_of_rank_offsets",
    "safe_join",
]


def as_int_tuple(value: Any, name: str, key: str) -> Tuple[int, ...]:
    """`value` as a tuple of non-negative ints, or an exception naming `name` of `key`."""
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise CheckpointingException(
            f"{name} of {key!r} must be a sequence of ints: {value!r}"
        ) from e
    if any(v < 0 for v in out):
        raise CheckpointingException(f"{name} of {key!r} must be non-negative: {out}")
    return out


def check_replica_id(replica_id: Any, key: str) -> ReplicaId:
    """A validated replica id (a non-negative int or tuple of them) of `key`."""
    if isinstance(replica_id, bool):
        raise CheckpointingException(f"replica_id of {key!r} must be an int or tuple of ints")
    if isinstance(replica_id, int):
        if replica_id < 0:
            raise CheckpointingException(f"replica_id of {key!r} must be >= 0: {replica_id}")
        return replica_id
    return as_int_tuple(replica_id, "replica_id", key)


def _check_same_length(key: str, offset: Tuple[int, ...], shape: Tuple[int, ...]) -> None:
    if len(offset) != len(shape):
        raise CheckpointingException(
            f"global_offset {offset} and global_shape {shape} of {key!r} have different lengths"
        )


def check_sharded_object(obj: ShardedObject) -> None:
    """Checks that `obj` has a safe key and lies inside its grid; normalizes int tuples."""
    check_key_is_safe_relative_path(obj.key, "ShardedObject key")
    obj.global_shape = as_int_tuple(obj.global_shape, "global_shape", obj.key)
    obj.global_offset = as_int_tuple(obj.global_offset, "global_offset", obj.key)
    obj.replica_id = check_replica_id(obj.replica_id, obj.key)
    _check_same_length(obj.key, obj.global_offset, obj.global_shape)
    if any(o >= s for o, s in zip(obj.global_offset, obj.global_shape)):
        raise CheckpointingException(
            f"global_offset {obj.global_offset} of {obj.key!r} lies outside "
            f"global_shape {obj.global_shape}"
        )


def check_sharded_tensor(st: ShardedTensor) -> None:
    """Checks that `st` describes a valid piece of its global tensor; normalizes int tuples."""
    key = st.key
    if not isinstance(key, str) or not key or "\x00" in key:
        raise CheckpointingException(f"ShardedTensor key must be a non-empty string: {key!r}")
    if not isinstance(st.dtype, torch.dtype):
        raise CheckpointingException(f"dtype of {key!r} must be a torch.dtype: {st.dtype!r}")
    st.local_shape = as_int_tuple(st.local_shape, "local_shape", key)
    st.global_shape = as_int_tuple(st.global_shape, "global_shape", key)
    st.global_offset = as_int_tuple(st.global_offset, "global_offset", key)
    st.replica_id = check_replica_id(st.replica_id, key)
    if not isinstance(st.prepend_axis_num, int) or st.prepend_axis_num < 0:
        raise CheckpointingException(
            f"prepend_axis_num of {key!r} must be a non-negative int: {st.prepend_axis_num!r}"
        )
    fr = st.flattened_range
    if fr is not None:
        volume = math.prod(st.local_shape)
        if not isinstance(fr, slice) or fr.step not in (None, 1):
            raise CheckpointingException(
                f"flattened_range of {key!r} must be a slice without step: {fr!r}"
            )
        ints = isinstance(fr.start, int) and isinstance(fr.stop, int)
        if not (ints and 0 <= fr.start <= fr.stop <= volume):
            raise CheckpointingException(
                f"flattened_range {fr!r} of {key!r} must lie within the {volume} elements "
                f"of local_shape {st.local_shape}"
            )
    if st.data is not None:
        if not isinstance(st.data, torch.Tensor):
            raise CheckpointingException(
                f"data of {key!r} must be a torch.Tensor, got {type(st.data).__name__}"
            )
        if st.data.dtype != st.dtype:
            raise CheckpointingException(
                f"data dtype {st.data.dtype} of {key!r} differs from dtype {st.dtype}"
            )
        expected, what = st.local_shape, "local_shape"
        if fr is not None:
            expected, what = (fr.stop - fr.start,), "the 1-D flattened_range length"
        if tuple(st.data.shape) != expected:
            raise CheckpointingException(
                f"data shape {tuple(st.data.shape)} of {key!r} differs from {what} {expected}"
            )
    ndim = len(st.global_shape)
    _check_same_length(key, st.global_offset, st.global_shape)
    if len(st.local_shape) + st.prepend_axis_num != ndim:
        raise CheckpointingException(
            f"local_shape {st.local_shape} with prepend_axis_num={st.prepend_axis_num} "
            f"does not match global_shape {st.global_shape} of {key!r}"
        )
    for axis, (off, size, glob) in enumerate(
        zip(st.global_offset, st.prepended_local_shape, st.global_shape)
    ):
        if off + size > glob:
            raise CheckpointingException(
                f"Shard of {key!r} at offset {st.global_offset} with shape "
                f"{st.prepended_local_shape} exceeds global_shape {st.global_shape} "
                f"on axis {axis}"
            )
    if st.axis_fragmentations is not None:
        st.axis_fragmentations = as_int_tuple(st.axis_fragmentations, "axis_fragmentations", key)
        if len(st.axis_fragmentations) != ndim or any(f < 1 for f in st.axis_fragmentations):
            raise CheckpointingException(
                f"axis_fragmentations {st.axis_fragmentations} of {key!r} must hold one "
                f"positive int per global axis ({ndim})"
            )
        for off, size in zip(st.global_offset[st.prepend_axis_num :], st.local_shape):
            if size != 0 and off % size != 0:
                raise CheckpointingException(
                    f"global_offset {off} of {key!r} is not a multiple of the local size "
                    f"{size} on a regular grid"
                )


def grid_of_rank_offsets(
    key: str,
    local_shape: Tuple[int, ...],
    prepend_axis_num: int,
    rank_offsets: Sequence[Tuple[int, int, int]],
) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """`(global_shape, global_offset, axis_fragmentations)` of a piece of `local_shape` placed
    by `(axis, axis_rank_offset, axis_fragmentations)` triples (`from_rank_offsets`)."""
    ndim = len(local_shape) + prepend_axis_num
    global_offset = [0] * ndim
    global_shape = [1] * prepend_axis_num + list(local_shape)
    fragmentations = [1] * ndim
    seen = set()
    for triple in rank_offsets:
        if len(triple) != 3:
            raise CheckpointingException(
                f"rank offset {triple!r} of {key!r} must be (axis, axis_rank_offset, "
                "axis_fragmentations)"
            )
        axis, pos, fragm = (int(v) for v in triple)
        if not 0 <= axis < ndim or fragm < 1 or not 0 <= pos < fragm or axis in seen:
            raise CheckpointingException(
                f"Invalid rank offsets {tuple(rank_offsets)} for {key!r} (global ndim {ndim})"
            )
        seen.add(axis)
        local = 1 if axis < prepend_axis_num else local_shape[axis - prepend_axis_num]
        global_shape[axis] = local * fragm
        global_offset[axis] = local * pos
        fragmentations[axis] = fragm
    return tuple(global_shape), tuple(global_offset), tuple(fragmentations)


def check_key_is_safe_relative_path(key: str, what: str = "key") -> None:
    """Raises `CheckpointingException` unless `key` (named `what` in messages) is a safe
    relative path: non-empty, not absolute, no NUL or backslash, no empty/`.`/`..` part."""
    if not isinstance(key, str) or not key:
        raise CheckpointingException(f"Invalid {what} {key!r}: must be a non-empty string")
    if "\x00" in key or "\\" in key:
        raise CheckpointingException(f"Invalid {what} {key!r}: NUL and backslash are not allowed")
    if key.startswith("/") or os.path.isabs(key):
        raise CheckpointingException(f"Invalid {what} {key!r}: absolute paths are not allowed")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise CheckpointingException(
                f"Invalid {what} {key!r}: path components may not be empty, '.' or '..'"
            )


def check_separation_hint(hint: Optional[str]) -> None:
    """Refuses a `separation_hint` that would not make a plain file name in the checkpoint
    directory (it starts the names of the files it selects).

    Raises:
        CheckpointingException: naming the hint and why.
    """
    if hint is None or hint == "":
        return
    why = ""
    if not isinstance(hint, str):
        why = f"it is a {type(hint).__name__}, not a str"
    elif any(c in hint for c in "/\\\0") or os.path.isabs(hint):
        why = "it holds a path separator (files go inside the checkpoint directory only)"
    elif hint.startswith("."):
        why = "it starts with '.' (a relative path, or a hidden name that tools skip)"
    if why:
        raise CheckpointingException(
            f"separation_hint {hint!r} is refused: {why}; it prefixes data file names, so "
            "use a plain name such as 'optimizer.'"
        )


def safe_join(root: str | os.PathLike[str], key: str, suffix: str = "") -> Path:
    """Joins `key + suffix` under `root`; raises `CheckpointingException` if unsafe."""
    check_key_is_safe_relative_path(key)
    root_path = Path(root)
    path = root_path.joinpath(*key.split("/"))
    if suffix:
        path = path.with_name(path.name + suffix)
    if root_path.resolve() not in path.resolve().parents:
        raise CheckpointingException(f"Key {key!r} resolves outside checkpoint dir {root}")
    return path
