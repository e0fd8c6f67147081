"""Flat shards (`ShardedTensor.flattened_range`) as ordinary N-D pieces.

A flat range of a row-major grid piece is a union of at most `2 * ndim - 1` boxes (partial
leading row, whole rows, partial trailing row, recursively). A flat shard is saved and
loaded as those boxes, with views of the flat tensor as data, through a
`ShardedTensorFactory`; the checkpoint holds an ordinary N-D tensor that any layout reads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Tuple

import torch

from .dict_utils import dict_list_map_inplace
from .mapping import ShardedTensor, ShardedTensorFactory

__all__ = ["flat_range_boxes", "expand_flat_shards", "flat_shard_pieces", "in_place_factory"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # offset in the piece, shape, flat start


def flat_range_boxes(shape: Tuple[int, ...], start: int, stop: int) -> List[Box]:
    """Splits the flat range `[start, stop)` of a row-major `shape` into boxes: `(offset,
    box_shape, flat_start)` triples in flat order, covering the range exactly once."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def row(i: int, lo: int, hi: int) -> List[Box]:  # the range [lo, hi) of row i
        return [
            ((i, *o), (1, *s), i * inner + f) for o, s, f in flat_range_boxes(shape[1:], lo, hi)
        ]

    if first == last:  # inside one row
        return row(first, head, tail)
    boxes = row(first, head, inner) if head else []
    whole = first + 1 if head else first  # the first whole row
    if last > whole:
        boxes.append(((whole, *(0,) * (len(shape) - 1)), (last - whole, *shape[1:]), whole * inner))
    return boxes + row(last, 0, tail)


def flat_shard_pieces(sh: ShardedTensor) -> List[ShardedTensor]:
    """The ordinary pieces (one per box, data viewing the flat data) of a flat shard with
    data; an empty range gives one empty piece, so the key still takes part in checks."""
    assert sh.flattened_range is not None and sh.data is not None
    start, stop = int(sh.flattened_range.start), int(sh.flattened_range.stop)
    p = sh.prepend_axis_num
    chunk_offset = sh.global_offset[p:]
    boxes = flat_range_boxes(tuple(sh.local_shape), start, stop)
    if not boxes and sh.local_shape:
        boxes = [((0,) * len(sh.local_shape), (0, *sh.local_shape[1:]), start)]
    meta = (sh.replica_id, p, sh.allow_shape_mismatch)
    pieces = []
    for offset, shape, flat_start in boxes:
        n = math.prod(shape)
        data = sh.data[flat_start - start : flat_start - start + n].view(shape)
        off = tuple(sh.global_offset[:p]) + tuple(o + c for o, c in zip(offset, chunk_offset))
        pieces.append(
            ShardedTensor(sh.key, data, sh.dtype, shape, sh.global_shape, off, None, *meta)
        )
    return pieces


def _as_factory(sh: ShardedTensor) -> ShardedTensorFactory:
    if sh.data is None or sh.data.device.type == "meta":  # a load allocates the flat data
        sh = replace(sh, data=None)
        sh.init_data("cpu")
    pieces = flat_shard_pieces(sh)
    return in_place_factory(sh, sh.data, {str(i): piece for i, piece in enumerate(pieces)})


def in_place_factory(
    sh: ShardedTensor, result: Any, pieces: Dict[str, ShardedTensor]
) -> ShardedTensorFactory:
    """A factory of `pieces` (views of `result`) whose merge returns `result`."""

    def merge(loaded: Any) -> Any:
        # loads fill the views in place; a backend that returns its own tensors is copied in
        for name, piece in pieces.items():
            got = loaded[name]
            assert piece.data is not None
            if isinstance(got, torch.Tensor) and got.data_ptr() != piece.data.data_ptr():
                piece.data.copy_(got)
        return result

    return ShardedTensorFactory(sh.key, result, lambda *_: dict(pieces), merge, sh.replica_id)


def expand_flat_shards(tree: Any) -> Any:
    """Replaces every flat ShardedTensor in `tree` (in place) by a factory of its pieces."""

    def convert(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and x.flattened_range is not None:
            return _as_factory(x)
        return x

    return dict_list_map_inplace(convert, tree) if isinstance(tree, (dict, list)) else tree
