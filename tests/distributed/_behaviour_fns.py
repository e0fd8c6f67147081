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


def flat_layout_state(
    key: str,
    global_shape: Tuple[int, ...],
    grid_axis: int,
    flat_splits: List[int],
    with_data: bool,
) -> Dict[str, Any]:
    """Distributed-optimizer style flat shards of `global_tensor(global_shape)`.

    The tensor is split in `world` grid pieces along `grid_axis` (as tensor parallelism
    does); each piece's flattening is cut at the fractions `flat_splits` (in elements,
    clipped to the piece) and the resulting ranges are dealt to the ranks round-robin, so
    every rank holds flat ranges of several pieces, crossing row boundaries, some empty.
    """
    r, w = dist.get_rank(), dist.get_world_size()
    g = global_tensor(global_shape)
    piece_shape = list(global_shape)
    piece_shape[grid_axis] //= w
    n = math.prod(piece_shape)
    cuts = sorted({0, n, *(min(c, n) for c in flat_splits)})
    out = []
    turn = 0
    for piece in range(w):
        index = [slice(None)] * len(global_shape)
        index[grid_axis] = slice(
            piece * piece_shape[grid_axis], (piece + 1) * piece_shape[grid_axis]
        )
        flat = g[tuple(index)].flatten()
        for a, b in zip(cuts[:-1], cuts[1:]):
            if turn % w == r:
                data = flat[a:b].clone() if with_data else torch.full((b - a,), float("nan"))
                out.append(
                    ShardedTensor.from_rank_offsets_flat(
                        key,
                        data,
                        tuple(piece_shape),
                        (grid_axis, piece, w),
                        flattened_range=slice(a, b),
                    )
                )
            turn += 1
    return {"flat": out, "step": 3}


def save_flat_layout(
    root: str, key: str, global_shape: Tuple[int, ...], grid_axis: int, flat_splits: List[int]
) -> None:
    """Saves `flat_layout_state` with data."""
    dc.save(flat_layout_state(key, global_shape, grid_axis, flat_splits, True), root)


def load_flat_layout(
    root: str, key: str, global_shape: Tuple[int, ...], grid_axis: int, flat_splits: List[int]
) -> List[str]:
    """Loads `flat_layout_state`; returns the problems found (empty when exact)."""
    want = flat_layout_state(key, global_shape, grid_axis, flat_splits, True)["flat"]
    got = dc.load(flat_layout_state(key, global_shape, grid_axis, flat_splits, False), root)
    return [
        f"rank {dist.get_rank()} range {w.flattened_range}: {g} != {w.data}"
        for w, g in zip(want, got["flat"], strict=True)
        if not torch.equal(g, w.data)
    ]


def tensors_metadata(root: str) -> Dict[str, str]:
    """`load_tensors_metadata(root)` as comparable strings."""
    return {k: str(v) for k, v in dc.load_tensors_metadata(root).items()}


def overlapping_flat_state() -> Dict[str, Any]:
    """Every rank claims the flat range [0, 8) of the same piece: an overlap."""
    return {
        "f": ShardedTensor.from_rank_offsets_flat(
            "f", torch.ones(8), (4, 4), flattened_range=slice(0, 8)
        )
    }
