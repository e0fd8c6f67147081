"""Flat shards (`ShardedTensor.flattened_range`) as ordinary N-D pieces.

A flat shard holds a contiguous range of the row-major flattening of a grid piece. That
range is exactly a union of at most `2 * ndim - 1` boxes, each itself a contiguous run of
the flat data: a partial leading row, a block of whole rows, a partial trailing row, and so
on recursively along the inner axes. So a flat shard is saved as those boxes, whose data
are views of the flat tensor (no copy), and loaded by asking for the same boxes with views
of the flat destination as their data. The checkpoint then holds an ordinary N-D tensor:
any layout, flat or not, on any world size, reads it, and its metadata is the unflattened
tensor's.

The expansion is a `ShardedTensorFactory`, so the usual factory machinery of save and
load (build before, merge after) applies it and puts the flat tensor back.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Tuple

import torch

from .dict_utils import dict_list_map_inplace
from .mapping import ShardedTensor, ShardedTensorFactory

__all__ = ["flat_range_boxes", "expand_flat_shards", "flat_shard_pieces"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # offset in the piece, shape, flat start


def flat_range_boxes(shape: Tuple[int, ...], start: int, stop: int) -> List[Box]:
    """Splits the flat range `[start, stop)` of a row-major `shape` into boxes.

    Args:
        shape: the (non-flat) shape.
        start: first flat index.
        stop: one past the last flat index.

    Returns:
        `(offset, box_shape, flat_start)` triples in flat order; each box covers the flat
        indices `[flat_start, flat_start + prod(box_shape))`, and together they cover the
        range exactly once. Empty for an empty range.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = (0,) * (len(shape) - 1)
    if first == last:  # inside one row
        return [
            ((first, *o), (1, *s), first * inner + f)
            for o, s, f in flat_range_boxes(tuple(shape[1:]), head, tail)
        ]
    boxes: List[Box] = []
    if head:
        boxes += [
            ((first, *o), (1, *s), first * inner + f)
            for o, s, f in flat_range_boxes(tuple(shape[1:]), head, inner)
        ]
        first += 1
    if last > first:
        boxes.append(((first, *rest), (last - first, *shape[1:]), first * inner))
    if tail:
        boxes += [
            ((last, *o), (1, *s), last * inner + f)
            for o, s, f in flat_range_boxes(tuple(shape[1:]), 0, tail)
        ]
    return boxes


def flat_shard_pieces(sh: ShardedTensor) -> List[ShardedTensor]:
    """The ordinary pieces of a flat shard, their data views of its flat data.

    Args:
        sh: a ShardedTensor with `flattened_range` and data (1-D).

    Returns:
        One ShardedTensor per box of its range (irregular grid; same key, dtype, global
        shape, replica id, prepended axes and shape-mismatch flag). An empty range gives
        one empty piece, so the key still takes part in validation and strict checks.
    """
    assert sh.flattened_range is not None and sh.data is not None
    start = int(sh.flattened_range.start)
    stop = int(sh.flattened_range.stop)
    p = sh.prepend_axis_num
    chunk_offset = sh.global_offset[p:]
    boxes = flat_range_boxes(tuple(sh.local_shape), start, stop)
    if not boxes and sh.local_shape:
        boxes = [((0,) * len(sh.local_shape), (0, *sh.local_shape[1:]), start)]
    pieces = []
    for offset, shape, flat_start in boxes:
        n = math.prod(shape)
        data = sh.data[flat_start - start : flat_start - start + n].view(shape)
        pieces.append(
            ShardedTensor(
                sh.key,
                data,
                sh.dtype,
                shape,
                sh.global_shape,
                tuple(sh.global_offset[:p]) + tuple(o + c for o, c in zip(offset, chunk_offset)),
                None,
                sh.replica_id,
                p,
                sh.allow_shape_mismatch,
            )
        )
    return pieces


def _as_factory(sh: ShardedTensor) -> ShardedTensorFactory:
    if sh.data is None or sh.data.device.type == "meta":  # a load allocates the flat data
        sh = replace(sh, data=None)
        sh.init_data("cpu")
    flat = sh.data
    assert flat is not None
    pieces = flat_shard_pieces(sh)

    def build(*_: Any) -> Dict[str, Any]:
        return {str(i): piece for i, piece in enumerate(pieces)}

    def merge(loaded: Any) -> torch.Tensor:
        # loads fill the views in place; a backend that returns its own tensors is copied in
        for i, piece in enumerate(pieces):
            got = loaded[str(i)]
            assert piece.data is not None
            if isinstance(got, torch.Tensor) and got.data_ptr() != piece.data.data_ptr():
                piece.data.copy_(got)
        return flat

    return ShardedTensorFactory(sh.key, flat, build, merge, sh.replica_id)


def expand_flat_shards(tree: Any) -> Any:
    """Replaces every flat ShardedTensor in `tree` (in place) by a factory of its pieces."""

    def convert(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and x.flattened_range is not None:
            return _as_factory(x)
        return x

    return dict_list_map_inplace(convert, tree) if isinstance(tree, (dict, list)) else tree
