"""Rank side of the DTensor layout property test: one global tensor saved in one layout
(a DTensor on some mesh and placements, or megatron-style ShardedTensor row blocks) and
loaded into another; each rank compares what it got with its piece of the global tensor."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor

#: a layout: ("dtensor", mesh_shape, placements) with placements as ("S", d), ("R",),
#: ("SS", d, split_factor); or ("rows",): ShardedTensor row blocks, torch.chunk-sized
Layout = Tuple[Any, ...]

_meshes: Dict[Tuple[int, ...], Any] = {}


def _mesh(shape: Tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _meshes:  # building a mesh is collective and slow: once per shape
        _meshes[shape] = init_device_mesh("cpu", shape)
    return _meshes[shape]


def _placements(spec: Tuple[Tuple[Any, ...], ...]) -> List[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # as FSDP2 makes it

    out: List[Any] = []
    for p in spec:
        if p[0] == "S":
            out.append(Shard(p[1]))
        elif p[0] == "SS":
            out.append(_StridedShard(p[1], split_factor=p[2]))
        else:
            out.append(Replicate())
    return out


def _global(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * 1.37 + 0.5).to(dtype).reshape(shape)


def _leaf(layout: Layout, full: torch.Tensor, fill: bool) -> Tuple[Any, torch.Tensor]:
    """`(leaf of the state dict, this rank's expected local data)` for `layout`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout[0] == "rows":
        rows = max(-(-full.shape[0] // world), 1)
        start = min(rank * rows, full.shape[0])
        local = full.narrow(0, start, min(rows, full.shape[0] - start)).clone()
        data = local if fill else torch.zeros_like(local)
        offset = (start, *(0,) * (full.dim() - 1))
        leaf = ShardedTensor(
            "t", data, full.dtype, tuple(local.shape), tuple(full.shape), offset, None
        )
        return leaf, local
    from torch.distributed.tensor import distribute_tensor

    dt = distribute_tensor(full, _mesh(layout[1]), _placements(layout[2]), src_data_rank=None)
    expected = dt.to_local().clone()
    if not fill:
        dt.to_local().zero_()
    return dt, expected


def run_cases(cases: List[Tuple[Tuple[int, ...], Any, Layout, Layout]], root: str) -> List[str]:
    """Saves and loads each `(shape, dtype, saved layout, requested layout)`; returns 'same',
    'differs: ...' or the error for each."""
    from torch.distributed.tensor import DTensor

    out = []
    for i, (shape, dtype, saved, requested) in enumerate(cases):
        full = _global(shape, dtype)
        ckpt = os.path.join(root, str(i))
        try:
            dc.save({"t": _leaf(saved, full, True)[0]}, ckpt)
            leaf, want = _leaf(requested, full, False)
            got = dc.load({"t": leaf}, ckpt)["t"]
            if isinstance(leaf, DTensor):
                ok = got is leaf  # filled in place, returned as requested
                got = got.to_local()
            else:
                ok = True
            ok = ok and got.shape == want.shape and torch.equal(got, want)
            out.append("same" if ok else f"differs: {got.tolist()} != {want.tolist()}")
        except Exception as e:  # reported to the test process
            out.append(f"{type(e).__name__}: {e}")
    return out
