"""Hypothesis strategies for global tensors and their shardings across ranks.

A sharding is, for each rank, a list of boxes `(offset, size, replica_id)` in global
coordinates. Boxes come from cutting each axis at random points (irregular grids); each
box gets one main replica on a random rank and maybe extra non-main replicas elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]

# offset, size, replica_id[, (start, stop)]: with the 4th element, a flat shard holding that
# range of the row-major flattening of the (non-prepended) box
Box = Tuple[Any, ...]


@dataclass
class Case:
    """One round-trip case: a global tensor, how it is saved and how it is loaded."""

    key: str
    global_shape: Tuple[int, ...]
    dtype: torch.dtype
    seed: int
    prepend_axis_num: int
    save: List[List[Box]]  # per rank
    load: List[List[Box]]  # per rank (may use another world's worth of pieces)


def make_global(case: Case) -> torch.Tensor:
    """The deterministic global tensor of a case."""
    g = torch.Generator().manual_seed(case.seed)
    shape = case.global_shape
    if case.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if case.dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g).to(torch.int8)
    if case.dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    return (torch.randn(shape, generator=g) * 100).to(case.dtype)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    # a dense copy: .contiguous() keeps a size-1 tensor's odd stride, which .view refuses
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of shape, dtype and bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_raw_bytes(a), _raw_bytes(b))) if a.numel() else True


@st.composite
def cuts(draw: st.DrawFn, size: int, every: bool) -> List[int]:
    if every:
        return list(range(size + 1))
    inner = draw(st.sets(st.integers(1, size - 1), max_size=3)) if size > 1 else set()
    return [0, *sorted(inner), size]


@st.composite
def empty_box(draw: st.DrawFn, shape: Tuple[int, ...], prepend: int) -> Box:
    """A zero-size box anywhere in `shape` (offsets up to the axis end), main replica."""
    empty_axis = draw(st.integers(prepend, len(shape) - 1))
    offset, size = [], []
    for axis, side in enumerate(shape):
        if axis < prepend:
            offset.append(draw(st.integers(0, side - 1)))
            size.append(1)
        else:
            off = draw(st.integers(0, side))
            offset.append(off)
            size.append(0 if axis == empty_axis else draw(st.integers(0, side - off)))
    return tuple(offset), tuple(size), 0


@st.composite
def shardings(
    draw: st.DrawFn,
    shape: Tuple[int, ...],
    prepend: int,
    world: int,
    replicas: bool = True,
    empties: bool = True,
    flats: bool = False,
) -> List[List[Box]]:
    """A valid sharding of `shape` over `world` ranks (main replicas tile it exactly).

    With `empties`, up to two zero-size boxes (empty shards, as uneven splits leave on
    some ranks) are added on random ranks. With `flats`, some boxes are instead cut into
    flat ranges (megatron-core <= 0.13's distributed optimizer layout), each on a random
    rank.
    """
    axis_cuts = [draw(cuts(size, every=axis < prepend)) for axis, size in enumerate(shape)]
    boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = [((), ())]
    for c in axis_cuts:
        boxes = [(o + (lo,), s + (hi - lo,)) for o, s in boxes for lo, hi in zip(c[:-1], c[1:])]
    per_rank: List[List[Box]] = [[] for _ in range(world)]
    for offset, size in boxes:
        n = math.prod(size[prepend:])
        if flats and n > 1 and draw(st.booleans()):
            inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3)))
            bounds = [0, *inner, n]
            for a, b in zip(bounds[:-1], bounds[1:]):
                per_rank[draw(st.integers(0, world - 1))].append((offset, size, 0, (a, b)))
            continue
        owner = draw(st.integers(0, world - 1))
        per_rank[owner].append((offset, size, 0))
        if replicas and world > 1 and draw(st.booleans()):
            other = draw(st.integers(0, world - 1).filter(lambda r, o=owner: r != o))
            per_rank[other].append((offset, size, 1))
    for _ in range(draw(st.integers(0, 2)) if empties else 0):
        per_rank[draw(st.integers(0, world - 1))].append(draw(empty_box(shape, prepend)))
    return per_rank


@st.composite
def cases(draw: st.DrawFn, world: int, index: int = 0, load_world: int = 0) -> Case:
    """A case saved over `world` ranks and loaded over `load_world` (default: the same)."""
    ndim = draw(st.integers(1, 4))
    max_side = {1: 40, 2: 12, 3: 6, 4: 4}[ndim]
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=ndim, max_size=ndim)))
    prepend = draw(st.integers(0, 1)) if ndim >= 2 and shape[0] <= 4 else 0
    return Case(
        key=f"t{index}.weight",
        global_shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
        prepend_axis_num=prepend,
        save=draw(shardings(shape, prepend, world, flats=True)),
        load=draw(shardings(shape, prepend, load_world or world, flats=True)),
    )


def box_count(per_rank: List[List[Box]]) -> int:
    return sum(len(b) for b in per_rank)


def volume(shape: Tuple[int, ...]) -> int:
    return math.prod(shape)


def row_block(key: str, w: torch.Tensor, r0: int, r1: int) -> Any:
    """A zero-filled request for rows `[r0, r1)` of the 2-d tensor `w`, stored as `key`."""
    from dist_checkpointing import ShardedTensor

    return ShardedTensor(
        key,
        torch.zeros(r1 - r0, w.shape[1], dtype=w.dtype),
        w.dtype,
        (r1 - r0, w.shape[1]),
        tuple(w.shape),
        (r0, 0),
        None,
    )
