"""Reading flattened-range checkpoints written by megatron-core <= 0.13.

megatron-core 0.13 stores a flat ShardedTensor (`flattened_range`, its distributed
optimizer's layout) "reformulated": a global tensor of shape `(X, Y, Z)` split on a grid of
pieces `(x, y, z)` is a DCP tensor of shape `(X // x, Y // y, Z // z, x*y*z)` whose chunks
are `(grid index..., flat start)` with sizes `(1, ..., 1, flat length)`;
`Metadata.mcore_data[key]['nd_reformulated_orig_global_shape']` records `(X, Y, Z)`. Each
stored chunk is a union of contiguous boxes of the original tensor (`flat_range_boxes`): a
request reads the ones it overlaps into temporaries and copies the overlaps out (no I/O here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..._flat import flat_range_boxes
from ...errors import CheckpointCorruptedError
from .plan import TensorRequest, overlap, require_covered

__all__ = ["reformulated_shapes", "FlatCopy", "plan_reformulated_reads", "apply_copies"]

_ORIG_SHAPE = "nd_reformulated_orig_global_shape"


def reformulated_shapes(metadata: Metadata) -> Dict[str, Tuple[int, ...]]:
    """`{key: original global shape}` of the tensors stored in megatron's flat layout.

    Raises:
        CheckpointCorruptedError: when a recorded shape does not fit its stored tensor.
    """
    mcore = getattr(metadata, "mcore_data", None)
    if not isinstance(mcore, dict):
        return {}
    out = {}
    for key, entry in mcore.items():
        shape = entry.get(_ORIG_SHAPE) if isinstance(entry, dict) else None
        stored = metadata.state_dict_metadata.get(key)
        if shape is None or not isinstance(stored, TensorStorageMetadata):
            continue
        try:
            orig = tuple(int(v) for v in shape)
        except (TypeError, ValueError) as e:
            raise CheckpointCorruptedError(f"{key!r}: malformed {_ORIG_SHAPE} {shape!r}") from e
        size = tuple(stored.size)
        grid = size[:-1]
        if (
            len(grid) != len(orig)
            or any(g < 1 or o % g for g, o in zip(grid, orig))
            or math.prod(o // g for o, g in zip(orig, grid)) != size[-1]
        ):
            raise CheckpointCorruptedError(
                f"{key!r}: stored flat layout {size} does not fit the recorded global shape {orig}"
            )
        out[key] = orig
    return out


@dataclass
class FlatCopy:
    """Copy, after the reads, of an overlap from a temporary run into a destination."""

    temp: torch.Tensor  # the run, shaped as its box
    box_offset: Tuple[int, ...]  # of the run's box, global
    dest_slot: int
    dest_offset: Tuple[int, ...]  # of the destination, global
    lo: Tuple[int, ...]  # overlap, global
    hi: Tuple[int, ...]


def plan_reformulated_reads(
    request: TensorRequest,
    stored: TensorStorageMetadata,
    orig_shape: Tuple[int, ...],
    dtype: torch.dtype,
    allow_partial: bool,
) -> Tuple[List[ReadItem], List[FlatCopy]]:
    """Plans the reads of `request`'s region of a tensor stored as `stored` in megatron's
    flat layout, `orig_shape` its shape: `(reads, copies)`, read i filling the temporary of
    copy i (slot `request.slot + 1 + i`), which moves an overlap into the destination.
    Raises `CheckpointingException` where the checkpoint holds only part of the region,
    unless `allow_partial`."""
    key, offsets, sizes = request.key, request.offsets, request.sizes
    grid = tuple(stored.size)[:-1]
    piece = tuple(o // g for o, g in zip(orig_shape, grid))
    reads: List[ReadItem] = []
    copies: List[FlatCopy] = []
    covered = 0
    for idx, chunk in enumerate(stored.chunks):
        cell = tuple(chunk.offsets)[:-1]
        start = int(chunk.offsets[-1])
        end = start + int(chunk.sizes[-1])
        origin = tuple(c * p for c, p in zip(cell, piece))
        for box_off, box_shape, flat_start in flat_range_boxes(piece, start, end):
            glob = tuple(o + b for o, b in zip(origin, box_off))
            ov = overlap(glob, box_shape, offsets, sizes)
            if ov is None:
                continue
            lo, hi = ov
            covered += math.prod(h - low for low, h in zip(lo, hi))
            slot = request.slot + 1 + len(copies)
            lengths = (1,) * len(grid) + (math.prod(box_shape),)
            reads.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(key, torch.Size(offsets), slot),
                    dest_offsets=torch.Size((0,) * len(lengths)),
                    storage_index=MetadataIndex(key, chunk.offsets, idx),
                    storage_offsets=torch.Size((0,) * len(grid) + (flat_start - start,)),
                    lengths=torch.Size(lengths),
                )
            )
            temp = torch.empty(box_shape, dtype=dtype)
            copies.append(FlatCopy(temp, glob, request.slot, tuple(offsets), lo, hi))
    require_covered(key, covered, offsets, sizes, allow_partial)
    return reads, copies


def apply_copies(copies: Sequence[FlatCopy], dests: Sequence[torch.Tensor]) -> None:
    """Copies each overlap (`plan_reformulated_reads`) into `dests` (views by slot)."""
    for c in copies:
        src = c.temp[tuple(slice(lo - b, hi - b) for lo, hi, b in zip(c.lo, c.hi, c.box_offset))]
        dst = dests[c.dest_slot][
            tuple(slice(lo - o, hi - o) for lo, hi, o in zip(c.lo, c.hi, c.dest_offset))
        ]
        dst.copy_(src)
