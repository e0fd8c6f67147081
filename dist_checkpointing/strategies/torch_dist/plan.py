"""Pure planning for the torch_dist backend (no files, no process groups): what to write
and what to read, in DCP's vocabulary, so DCP and megatron-core read the format."""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..._dcp_plain import PlainItem
from ...errors import CheckpointingException
from ...mapping import ShardedObject, ShardedTensor

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "DATA_SUFFIX",
    "data_file_name",
    "WriteEntry",
    "tensor_write_item",
    "object_write_item",
    "plain_entry",
    "serialize_object",
    "split_into_files",
    "is_empty_chunk",
    "TensorRequest",
    "ChunkIndex",
    "overlapping",
    "overlap",
    "require_covered",
    "plan_tensor_reads",
]

BACKEND = "torch_dist"
SUPPORTED_VERSIONS = (1,)
DATA_SUFFIX = ".distcp"


def data_file_name(group: str, rank: int, index: int) -> str:
    """Name of a rank's n-th data file; `group` is '' or the separation hint."""
    return f"{group}__{rank}_{index}{DATA_SUFFIX}"


@dataclass
class WriteEntry:
    """One item to write and where its data comes from (a tensor or serialized bytes)."""

    item: WriteItem
    data: object  # torch.Tensor for SHARD items, bytes for BYTE_IO items

    @property
    def nbytes(self) -> int:
        """Bytes of payload."""
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        assert isinstance(self.data, (bytes, bytearray, memoryview))
        return len(self.data)


def _chunk_item(
    key: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype, size: Sequence[int]
) -> WriteItem:
    """The DCP write item of one chunk (`offsets`, `sizes`) of a tensor of global `size`."""
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def tensor_write_item(sh: ShardedTensor) -> WriteItem:
    """The DCP write item of one ShardedTensor (prepended axes included in the chunk)."""
    return _chunk_item(
        sh.key, sh.global_offset, sh.prepended_local_shape, sh.dtype, sh.global_shape
    )


def object_write_item(sh: ShardedObject) -> WriteItem:
    """The DCP write item of one ShardedObject, stored as bytes under its unique key."""
    return WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO)


def plain_entry(item: PlainItem) -> WriteEntry:
    """The entry of a plain value of the common state, as `dcp.save` writes it: a tensor
    as one whole chunk, anything else as a byte item of `torch.save(value)`."""
    data = item.data
    if isinstance(data, torch.Tensor):
        write = _chunk_item(item.fqn, [0] * data.dim(), data.shape, data.dtype, data.shape)
        return WriteEntry(write, data)
    return WriteEntry(WriteItem(index=MetadataIndex(item.fqn), type=WriteItemType.BYTE_IO), data)


def serialize_object(obj: object) -> bytes:
    """Serializes a ShardedObject's data the way megatron-core does (`torch.save([obj])`)."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    return buf.getvalue()


def split_into_files(
    entries: Sequence[WriteEntry], files_per_rank: int, separation_hint: Optional[str] = None
) -> List[Tuple[str, List[WriteEntry]]]:
    """Groups a rank's entries into files of roughly equal byte size (largest first, each
    into the lightest file): `[(group, entries)]`, the group '' or the hint, none empty.

    Args:
        files_per_rank: files for each group (one writer thread each).
        separation_hint: entries whose key starts with it go to files named with it, so
            `remove_sharded_tensors(prefix)` can drop them whole.
    """
    hint = separation_hint or ""
    groups: Dict[str, List[WriteEntry]] = {}
    for e in entries:
        group = hint if hint and e.item.index.fqn.startswith(hint) else ""
        groups.setdefault(group, []).append(e)
    out: List[Tuple[str, List[WriteEntry]]] = []
    for group, items in groups.items():
        bins: List[List[WriteEntry]] = [[] for _ in range(max(1, files_per_rank))]
        sizes = [0] * len(bins)
        for e in sorted(items, key=lambda x: x.nbytes, reverse=True):
            i = sizes.index(min(sizes))
            bins[i].append(e)
            sizes[i] += e.nbytes
        out += [(group, b) for b in bins if b]
    return out


def is_empty_chunk(item: WriteItem) -> bool:
    """Whether `item` is a tensor chunk of zero elements (an empty shard: nothing to store)."""
    td = item.tensor_data
    return td is not None and math.prod(td.chunk.sizes) == 0


@dataclass(frozen=True)
class TensorRequest:
    """A region a rank wants to load: key, its slot id on this rank, global offsets, sizes."""

    key: str
    slot: int
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]


def overlapping(
    starts: np.ndarray, sizes: np.ndarray, offsets: Sequence[int], size: Sequence[int]
) -> np.ndarray:
    """Which of the boxes (rows of `starts` and `sizes`) share an element with one box."""
    lo = np.asarray(offsets, np.int64)
    return np.all((starts < lo + np.asarray(size, np.int64)) & (starts + sizes > lo), axis=1)


class ChunkIndex:
    """A stored tensor's chunk boxes as arrays, so a request finds the chunks it overlaps
    without a Python loop over all of them (a layer-stacked key has hundreds)."""

    def __init__(self, stored: TensorStorageMetadata) -> None:
        n, ndim = len(stored.chunks), len(stored.size)
        flat = itertools.chain.from_iterable
        starts = np.fromiter(flat(c.offsets for c in stored.chunks), np.int64, n * ndim)
        sizes = np.fromiter(flat(c.sizes for c in stored.chunks), np.int64, n * ndim)
        self.starts, self.sizes = starts.reshape(n, ndim), sizes.reshape(n, ndim)


def overlap(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The `(lo, hi)` corners of two boxes' overlap, or None where they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + sx, y + sy) for x, sx, y, sy in zip(a_off, a_size, b_off, b_size))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, hi


def require_covered(
    key: str, covered: int, offsets: Sequence[int], sizes: Sequence[int], allow_partial: bool
) -> None:
    """Raises `CheckpointingException` unless the stored chunks cover all elements of the
    region (`covered` of them) or `allow_partial`."""
    wanted = math.prod(sizes)
    if covered != wanted and not allow_partial:
        raise CheckpointingException(
            f"Checkpoint holds {covered} of the {wanted} elements requested for {key!r} "
            f"at offset {offsets} with shape {sizes}"
        )


def plan_tensor_reads(
    request: TensorRequest,
    stored: TensorStorageMetadata,
    allow_partial: bool = False,
    index: Optional[ChunkIndex] = None,
) -> List[ReadItem]:
    """The reads, one per overlapping stored chunk, that fill one requested region.

    Args:
        stored: the checkpoint's metadata of the requested tensor.
        allow_partial: accept a region the checkpoint covers only in part.
        index: `ChunkIndex(stored)`, built once per key when it serves several requests.

    Raises:
        CheckpointingException: part of the region is not in the checkpoint.
    """
    items = []
    covered = 0
    index = ChunkIndex(stored) if index is None else index
    hits = overlapping(index.starts, index.sizes, request.offsets, request.sizes)
    for idx in np.nonzero(hits)[0].tolist():
        chunk = stored.chunks[idx]
        ov = overlap(request.offsets, request.sizes, tuple(chunk.offsets), tuple(chunk.sizes))
        if ov is None:
            continue
        lo = list(ov[0])
        lengths = [h - low for low, h in zip(*ov)]
        covered += math.prod(lengths)
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(request.key, torch.Size(request.offsets), request.slot),
                dest_offsets=torch.Size([x - o for x, o in zip(lo, request.offsets)]),
                storage_index=MetadataIndex(request.key, chunk.offsets, idx),
                storage_offsets=torch.Size([x - o for x, o in zip(lo, chunk.offsets)]),
                lengths=torch.Size(lengths),
            )
        )
    require_covered(request.key, covered, request.offsets, request.sizes, allow_partial)
    return items
