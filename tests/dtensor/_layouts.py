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
#: ("SS", d, split_factor), and a fourth item "reversed" for a mesh holding the ranks in
#: reverse order; or ("rows",): ShardedTensor row blocks, torch.chunk-sized
Layout = Tuple[Any, ...]

_meshes: Dict[Tuple[Any, ...], Any] = {}


def _mesh(shape: Tuple[int, ...], reversed_ranks: bool = False) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    key = (shape, reversed_ranks)
    if key not in _meshes:  # building a mesh is collective and slow: once per shape
        if reversed_ranks:  # rank r at the mesh coordinate of rank world - 1 - r
            ranks = torch.arange(dist.get_world_size()).flip(0).reshape(shape)
            _meshes[key] = DeviceMesh("cpu", ranks)
        else:
            _meshes[key] = init_device_mesh("cpu", shape)
    return _meshes[key]


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

    # src_data_rank=None: each rank keeps its piece of its own copy (DTensor's scatter from
    # one rank follows group ranks, not mesh coordinates, on a reversed mesh in torch 2.13)
    mesh = _mesh(layout[1], layout[3:] == ("reversed",))
    dt = distribute_tensor(full, mesh, _placements(layout[2]), src_data_rank=None)
    expected = dt.to_local().clone()
    if not fill:
        dt.to_local().zero_()
    return dt, expected


def _where(offsets: Any, sizes: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """`(offsets, sizes)`; an empty piece has no position worth comparing."""
    sizes = tuple(int(s) for s in sizes)
    return (() if 0 in sizes else tuple(int(o) for o in offsets)), sizes


def _chunks(dt: Any) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Where DTensor's own chunk list (what DCP saves by) puts the local tensor."""
    return sorted(_where(c.offsets, c.sizes) for c in dt.__create_chunk_list__())


def _pieces(dt: Any) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Where our layout puts it (the pieces' offsets and shapes)."""
    from dist_checkpointing.dtensor import dtensor_pieces

    return sorted(_where(p.global_offset, p.local_shape) for p in dtensor_pieces("t", dt) or [])


def run_cases(cases: List[Tuple[Tuple[int, ...], Any, Layout, Layout]], root: str) -> List[str]:
    """Saves and loads each `(shape, dtype, saved layout, requested layout)`; returns 'same',
    'differs: ...' or the error for each."""
    from torch.distributed.tensor import DTensor

    out = []
    for i, (shape, dtype, saved, requested) in enumerate(cases):
        full = _global(shape, dtype)
        ckpt = os.path.join(root, str(i))
        try:
            source = _leaf(saved, full, True)[0]
            agree = not isinstance(source, DTensor) or _chunks(source) == _pieces(source)
            dc.save({"t": source}, ckpt)
            leaf, want = _leaf(requested, full, False)
            got = dc.load({"t": leaf}, ckpt)["t"]
            if isinstance(leaf, DTensor):
                ok = got is leaf  # filled in place, returned as requested
                got = got.to_local()
            else:
                ok = True
            ok = ok and got.shape == want.shape and torch.equal(got, want)
            if not agree:  # reported after the collectives, which every rank must make
                out.append(f"chunk list {_chunks(source)} != our pieces {_pieces(source)}")
            else:
                out.append("same" if ok else f"differs: {got.tolist()} != {want.tolist()}")
        except Exception as e:  # reported to the test process
            out.append(f"{type(e).__name__}: {e}")
    return out
