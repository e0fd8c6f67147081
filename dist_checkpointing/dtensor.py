"""`torch.distributed.tensor.DTensor` leaves as ShardedTensor pieces.

A DTensor knows its global shape, its mesh, this rank's mesh coordinate and one placement
per mesh dimension. From those alone (no collective) `local_regions` works out which global
indices this rank's local tensor holds along each axis, following DTensor's own rules:
placements apply left to right over the mesh dimensions; `Shard(d)` splits the indices
still held along axis `d` like `torch.chunk` (ceil-sized chunks, the last ones short or
empty); `_StridedShard(d, split_factor=f)` (FSDP2 over tensor parallelism) first splits them
into `f` chunks, splits each of those, and keeps this coordinate's piece of every one;
`Replicate()` holds everything and makes every coordinate but 0 a replica. `Partial()`
holds a summand, not a value, and is refused.

The held indices of an axis are a list of contiguous runs; the local tensor is the product
of the runs of all axes, so it becomes one `ShardedTensor` per product box (one box in
every layout FSDP2 and tensor parallelism make), each a view of the local tensor. Its key
is the DCP flat name of the leaf. Saving writes those boxes; loading fills the views, so the
DTensor of the request is filled in place and returned as it is (its mesh and placements).

The trade-off taken: we compute the layout ourselves instead of calling torch's private
`compute_local_shape_and_global_offset`, and refuse a DTensor whose local shape disagrees
with it (a placement we do not know) rather than write a wrong offset.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._flat import in_place_factory
from .errors import CheckpointingException
from .mapping import ShardedTensor, ShardedTensorFactory

__all__ = [
    "Placement",
    "Runs",
    "dtensor_factory",
    "dtensor_pieces",
    "fill_from_full",
    "is_dtensor",
    "local_regions",
    "placements_of",
]

logger = logging.getLogger(__name__)

#: a placement as a plain tuple: ("shard", dim), ("strided", dim, split_factor),
#: ("replicate",) or ("partial",)
Placement = Tuple[Any, ...]
#: the global indices held along one axis: `(start, stop)` runs in local order
Runs = List[Tuple[int, int]]


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a `torch.distributed.tensor.DTensor` (without importing it when
    torch.distributed is unavailable)."""
    if not isinstance(value, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def placements_of(key: str, placements: Sequence[Any]) -> List[Placement]:
    """DTensor placements as plain tuples (see `Placement`).

    Raises:
        CheckpointingException: on `Partial` or a placement this module does not know.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: List[Placement] = []
    for p in placements:
        # _StridedShard (FSDP2 over tensor parallelism) is no Shard subclass: known by its
        # split factor
        split_factor = getattr(p, "split_factor", None)
        if split_factor is not None and isinstance(getattr(p, "dim", None), int):
            out.append(("strided", int(p.dim), int(split_factor)))
        elif isinstance(p, Shard):
            out.append(("shard", int(p.dim)))
        elif isinstance(p, Replicate):
            out.append(("replicate",))
        elif isinstance(p, Partial):
            raise CheckpointingException(
                f"DTensor {key!r} has a Partial placement ({p}): each rank holds a summand, "
                "not a value. Reduce it first (e.g. dtensor.redistribute(placements="
                "[Replicate()] ...) or .full_tensor()) and save that"
            )
        else:
            raise CheckpointingException(
                f"DTensor {key!r} has placement {p!r}, which dist_checkpointing cannot place; "
                "redistribute it to Shard/Replicate placements before saving or loading"
            )
    return out


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """Positions `[start, stop)` of the index list that `runs` spell out, as runs."""
    out: Runs = []
    pos = 0
    for a, b in runs:
        lo, hi = max(start, pos), min(stop, pos + (b - a))
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    """Chunk `index` of `parts` of the runs' index list, as `torch.chunk` splits it."""
    total = sum(b - a for a, b in runs)
    size = -(-total // parts)
    return _take(runs, min(index * size, total), min((index + 1) * size, total))


def _merge(runs: Runs) -> Runs:
    out: Runs = []
    for a, b in runs:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def local_regions(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Tuple[List[Runs], int]:
    """The global indices one mesh coordinate holds, axis by axis, and its replica id.

    Pure: a function of the layout only, so it runs without a process group.

    Args:
        global_shape: the DTensor's global shape.
        mesh_shape: the device mesh's shape.
        coordinate: this rank's mesh coordinate.
        placements: one `Placement` per mesh dimension (no "partial").

    Returns:
        `(runs, replica_id)`: per axis, the held global indices as `(start, stop)` runs in
        the order the local tensor holds them (empty when the local tensor is empty along
        it); `replica_id` 0 on the coordinate that writes this data, else positive.
    """
    held: List[Runs] = [[(0, int(n))] if n else [] for n in global_shape]
    replica, replica_stride = 0, 1
    for size, coord, p in zip(mesh_shape, coordinate, placements):
        if p[0] == "replicate":
            replica += coord * replica_stride
            replica_stride *= size
        elif p[0] == "shard":
            held[p[1]] = _chunk(held[p[1]], size, coord)
        elif p[0] == "strided":
            pieces = [_chunk(held[p[1]], p[2], j) for j in range(p[2])]
            held[p[1]] = [r for piece in pieces for r in _chunk(piece, size, coord)]
        else:
            raise ValueError(f"unknown placement {p!r}")
    return [_merge(r) for r in held], replica


def _boxes(
    runs: List[Runs], local_shape: Tuple[int, ...]
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """`(global_offset, local_offset, shape)` of each box of the product of `runs`; a local
    tensor empty along some axis gives one empty box, so its key still takes part in checks."""
    if any(n == 0 for n in local_shape) or not runs:
        offset = tuple(r[0][0] if r else 0 for r in runs)
        return [(offset, (0,) * len(runs), local_shape)]
    per_axis = []
    for axis_runs in runs:
        pos, entries = 0, []
        for a, b in axis_runs:
            entries.append((a, pos, b - a))
            pos += b - a
        per_axis.append(entries)
    return [
        (tuple(e[0] for e in combo), tuple(e[1] for e in combo), tuple(e[2] for e in combo))
        for combo in itertools.product(*per_axis)
    ]


def dtensor_pieces(key: str, dt: Any) -> Optional[List[ShardedTensor]]:
    """This rank's pieces of DTensor `dt` as ShardedTensors under `key` (views of its local
    tensor); None when this rank is not in the DTensor's mesh.

    Raises:
        CheckpointingException: on a Partial or unknown placement, or a local tensor whose
            shape is not the one the placements give.
    """
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    placements = placements_of(key, dt.placements)
    runs, replica = local_regions(tuple(dt.shape), tuple(mesh.shape), coordinate, placements)
    with torch.no_grad():  # to_local's autograd function costs more than the rest here
        local = dt.to_local().detach()
    held = tuple(sum(b - a for a, b in r) for r in runs)
    if type(local) is not torch.Tensor and type(local) is not torch.nn.Parameter:
        raise CheckpointingException(
            f"DTensor {key!r} wraps a {type(local).__name__} local tensor; only plain local "
            "tensors can be placed"
        )
    if tuple(local.shape) != held:
        raise CheckpointingException(
            f"DTensor {key!r} (global {tuple(dt.shape)}, placements {tuple(dt.placements)}, "
            f"mesh coordinate {tuple(coordinate)}) holds a local tensor of shape "
            f"{tuple(local.shape)}, but its placements give {held}; refusing to guess where it "
            "lies (redistribute it to plain Shard/Replicate placements)"
        )
    pieces = []
    for g_off, l_off, shape in _boxes(runs, tuple(local.shape)):
        data = local
        for axis, (start, n) in enumerate(zip(l_off, shape)):
            if n != local.shape[axis]:  # a whole axis needs no view
                data = data.narrow(axis, start, n)
        pieces.append(
            ShardedTensor(key, data, local.dtype, shape, tuple(dt.shape), g_off, None, replica)
        )
    if len(pieces) > 1:
        logger.debug("DTensor %r: local tensor is %d boxes of the global one", key, len(pieces))
    assert sum(math.prod(p.local_shape) for p in pieces) == local.numel()
    return pieces


def dtensor_factory(key: str, dt: Any) -> Optional[ShardedTensorFactory]:
    """A factory saving DTensor `dt` as its pieces and, on load, filling them in place and
    returning `dt` itself; None when this rank is not in the DTensor's mesh."""
    pieces = dtensor_pieces(key, dt)
    if pieces is None:
        return None
    return in_place_factory(pieces[0], dt, {str(i): p for i, p in enumerate(pieces)})


def fill_from_full(key: str, dt: Any, full: torch.Tensor) -> None:
    """Fills DTensor `dt`'s local tensor in place from `full`, the whole global tensor (a
    plain tensor stored under `key`).

    Raises:
        CheckpointingException: `full` has another shape or dtype than `dt`.
    """
    if tuple(full.shape) != tuple(dt.shape) or full.dtype != dt.dtype:
        raise CheckpointingException(
            f"{key!r} is stored as a plain tensor of shape {tuple(full.shape)} and dtype "
            f"{full.dtype}; the requested DTensor is {tuple(dt.shape)}, {dt.dtype}"
        )
    with torch.no_grad():
        for piece in dtensor_pieces(key, dt) or []:
            assert piece.data is not None
            piece.data.copy_(full[piece.global_slice()])
