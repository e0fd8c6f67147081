"""Rank functions for the user-behaviour tests (empty shards, shape mismatch, ...).

Module-level so a test world can run them by reference.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedTensor

Piece = Tuple[Tuple[int, ...], Tuple[int, ...]]  # global offset, local shape


def global_tensor(shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """A deterministic float32 tensor of `shape` (distinct values)."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32) + seed * 1000).reshape(tuple(shape))


def pieces_state(
    key: str,
    global_shape: Tuple[int, ...],
    layout: List[List[Piece]],
    with_data: bool,
    fill: float = float("nan"),
) -> Dict[str, Any]:
    """This rank's pieces of `layout` as ShardedTensors (real data, or filled with `fill`)."""
    g = global_tensor(global_shape)
    out = []
    for offset, size in layout[dist.get_rank()]:
        if with_data:
            data = g[tuple(slice(o, o + s) for o, s in zip(offset, size))].clone()
        else:
            data = torch.full(size, fill)
        out.append(ShardedTensor(key, data, torch.float32, size, global_shape, offset, None, 0, 0))
    return {"pieces": out, "step": 3}


def save_pieces(
    root: str, key: str, global_shape: Tuple[int, ...], layout: List[List[Piece]]
) -> None:
    """Saves this rank's pieces of `layout`."""
    dc.save(pieces_state(key, global_shape, layout, True), root)


def load_pieces(
    root: str, key: str, global_shape: Tuple[int, ...], layout: List[List[Piece]]
) -> List[str]:
    """Loads this rank's pieces of `layout`; returns the problems found (empty when exact)."""
    loaded = dc.load(pieces_state(key, global_shape, layout, False), root)
    g = global_tensor(global_shape)
    problems = []
    for (offset, size), got in zip(layout[dist.get_rank()], loaded["pieces"], strict=True):
        want = g[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        if tuple(got.shape) != tuple(size) or not torch.equal(got, want):
            problems.append(f"rank {dist.get_rank()} piece {offset} {size}: {got} != {want}")
    if loaded["step"] != 3:
        problems.append(f"common state {loaded['step']!r}")
    return problems


def column_block(
    key: str, rows: int, cols: int, allow_shape_mismatch: bool, with_data: bool
) -> Dict[str, Any]:
    """This rank's block of columns of a `rows x cols` tensor (cols split evenly)."""
    r, w = dist.get_rank(), dist.get_world_size()
    width = cols // w
    if with_data:
        data = global_tensor((rows, cols))[:, r * width : (r + 1) * width].clone()
    else:
        data = torch.full((rows, width), -7.0)  # what a load must never leave in place
    return {
        key: ShardedTensor.from_rank_offsets(
            key, data, (1, r, w), allow_shape_mismatch=allow_shape_mismatch
        )
    }


def save_columns(root: str, key: str, rows: int, cols: int) -> None:
    """Saves a `rows x cols` tensor split on columns over the world (shape mismatch allowed)."""
    dc.save(column_block(key, rows, cols, True, True), root)


def load_columns(
    root: str, key: str, rows: int, cols: int, allow_shape_mismatch: bool
) -> Optional[torch.Tensor]:
    """Loads this rank's column block of a `rows x cols` request."""
    return dc.load(column_block(key, rows, cols, allow_shape_mismatch, False), root)[key]


def phrase_state() -> Dict[str, Any]:
    """A valid two-rank state: a split tensor, one object per rank, common state."""
    from dist_checkpointing import ShardedObject

    r, w = dist.get_rank(), dist.get_world_size()
    return {
        "a": ShardedTensor.from_rank_offsets("a", torch.full((2,), float(r)), (0, r, w)),
        "obj": ShardedObject("obj", {"rank": r}, (w,), (r,)),
        "step": 1,
    }


def phrase_state_only_a() -> Dict[str, Any]:
    """Requests only 'a' (the checkpoint's 'obj' pieces are then missing keys)."""
    return {"a": phrase_state()["a"]}


def phrase_state_with_ghost() -> Dict[str, Any]:
    """Requests a key the checkpoint lacks, on the last rank only."""
    sd = phrase_state()
    if dist.get_rank() == dist.get_world_size() - 1:
        sd["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.empty(2), replica_id=1)
    return sd


def phrase_state_overlap() -> Dict[str, Any]:
    """Every rank claims the whole tensor as its main replica."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}


def phrase_state_duplicate_object() -> Dict[str, Any]:
    """Every rank saves the same object piece as main replica."""
    from dist_checkpointing import ShardedObject

    return {"obj": ShardedObject("obj", 1, (dist.get_world_size(),), (0,))}


def phrase_state_missing_object() -> Dict[str, Any]:
    """The last rank does not save its object piece: a grid cell with no main replica."""
    from dist_checkpointing import ShardedObject

    r, w = dist.get_rank(), dist.get_world_size()
    return {} if r == w - 1 else {"obj": ShardedObject("obj", 1, (w,), (r,))}
