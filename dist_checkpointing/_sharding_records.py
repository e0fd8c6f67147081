"""Shards as compact records, and the checks that a key's shards form one valid global
tensor or object grid: pure functions shared by `validation.find_sharding_problems` (every
rank's shards in one place) and the distributed check in `_sharding_agreement` (each key's
shards at the rank that owns the key)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .mapping import ShardedObject, ShardedTensor, is_main_replica

__all__ = ["ShardRecord", "record_of", "key_problems"]


class ShardRecord(NamedTuple):
    """What validation needs of one shard (metadata only; plain values, cheap to send).

    Field names follow `ShardedTensor`/`ShardedObject`, so the checks read either.
    """

    kind: str  # "t": a tensor shard, "o": an object
    key: str
    dtype: str  # "" for objects
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    prepended_local_shape: Tuple[int, ...]  # () for objects
    replica_id: int  # 0: the main replica

    @property
    def unique_key(self) -> str:
        """An object's key with its grid position (as `ShardedObject.unique_key`)."""
        loc = ".".join(map(str, self.global_offset))
        glob = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{loc}_{glob}"


def record_of(sh: Any) -> Optional[ShardRecord]:
    """The record of a `ShardedTensor` or `ShardedObject` (None for other leaves)."""
    if isinstance(sh, ShardedTensor):
        kind, dtype, local = "t", str(sh.dtype), tuple(sh.prepended_local_shape)
    elif isinstance(sh, ShardedObject):
        kind, dtype, local = "o", "", ()
    else:
        return None
    main = 0 if is_main_replica(sh.replica_id) else 1
    shape, offset = tuple(sh.global_shape), tuple(sh.global_offset)
    return ShardRecord(kind, sh.key, dtype, shape, offset, local, main)


def _first_overlap(starts: np.ndarray, ends: np.ndarray) -> Optional[Tuple[int, int]]:
    """One pair (i, j), i < j, of overlapping non-empty boxes, or None.

    Sweeps along the axis with the most distinct starts: a box is compared only with the
    boxes that start before it ends on that axis (not with every other box).
    """
    n, ndim = starts.shape
    nonempty = np.all(ends > starts, axis=1) if ndim else np.ones(n, dtype=bool)
    idx = np.nonzero(nonempty)[0]
    if len(idx) < 2:
        return None
    if ndim == 0:  # 0-d tensors: any two pieces are the same element
        return int(idx[0]), int(idx[1])
    axis = max(range(ndim), key=lambda d: len(np.unique(starts[idx, d])))
    order = idx[np.argsort(starts[idx, axis], kind="stable")]
    s, e = starts[order], ends[order]
    reach = np.searchsorted(s[:, axis], e[:, axis], side="left")
    for i in range(len(order)):
        if reach[i] <= i + 1:
            continue
        hit = np.nonzero(
            np.all((s[i + 1 : reach[i]] < e[i]) & (e[i + 1 : reach[i]] > s[i]), axis=1)
        )[0]
        if len(hit):
            a, b = int(order[i]), int(order[i + 1 + hit[0]])
            return min(a, b), max(a, b)
    return None


def _tensor_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    rank0, ref = shards[0]
    for rank, sh in shards[1:]:
        if sh.dtype != ref.dtype:
            return [
                f"{key!r}: dtype {sh.dtype} on rank {rank} differs from {ref.dtype} on rank {rank0}"
            ]
    main = [(rank, sh) for rank, sh in shards if sh.replica_id == 0]
    if not main:
        return [
            f"Invalid access pattern for {key!r}: no rank holds a main replica (replica_id 0), "
            "so it would not be saved"
        ]
    dims = (len(main), len(ref.global_shape))
    starts = np.array([sh.global_offset for _, sh in main], dtype=np.int64).reshape(dims)
    sizes = np.array([sh.prepended_local_shape for _, sh in main], dtype=np.int64).reshape(dims)
    pair = _first_overlap(starts, starts + sizes)
    if pair is not None:
        (ra, a), (rb, b) = main[pair[0]], main[pair[1]]
        return [
            f"Invalid access pattern for {key!r}: main replicas overlap: rank {ra} offset "
            f"{a.global_offset} shape {a.prepended_local_shape} and rank {rb} offset "
            f"{b.global_offset} shape {b.prepended_local_shape}"
        ]
    covered = sum(math.prod(sh.prepended_local_shape) for _, sh in main)
    total = math.prod(ref.global_shape)
    if covered != total:
        return [
            f"Invalid access pattern for {key!r}: main replicas cover {covered} of {total} "
            f"elements of global shape {ref.global_shape} (a gap)"
        ]
    return []


def _object_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    ref = shards[0][1]
    seen: Dict[Tuple[int, ...], int] = {}
    for rank, sh in shards:
        if sh.replica_id != 0:
            continue
        if sh.global_offset in seen:
            return [
                f"Duplicate ShardedObject keys: [{sh.unique_key!r}] (ShardedObject {key!r}: "
                f"offset {sh.global_offset} has main replicas on ranks "
                f"{seen[sh.global_offset]} and {rank})"
            ]
        seen[sh.global_offset] = rank
    total = math.prod(ref.global_shape)
    if len(seen) != total:
        return [
            f"Invalid access pattern: {total - len(seen)} ShardedObject are missing "
            f"(ShardedObject {key!r}: main replicas cover {len(seen)} of {total} pieces of "
            f"grid {ref.global_shape}, a gap)"
        ]
    return []


def key_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    """What is wrong with one key's shards from every rank (`(rank, record)`, rank order):
    a key used as both kinds, ranks disagreeing on shape or dtype, main replicas that
    overlap or leave a gap. Empty when valid."""
    kinds = {sh.kind for _, sh in shards}
    if len(kinds) > 1:
        return [f"{key!r} is used both as a ShardedTensor and a ShardedObject"]
    rank0, ref = shards[0]
    for rank, sh in shards[1:]:
        if sh.global_shape != ref.global_shape:
            what = "ShardedObject " if ref.kind == "o" else ""
            return [
                f"{what}{key!r}: global_shape {sh.global_shape} on rank {rank} differs from "
                f"{ref.global_shape} on rank {rank0}"
            ]
    if kinds == {"t"}:
        return _tensor_problems(key, shards)
    return _object_problems(key, shards)
