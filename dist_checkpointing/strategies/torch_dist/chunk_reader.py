"""Reading the rows of one stored tensor chunk that its reads need, verified as they land:
whole rows into a contiguous host destination of the stored dtype land in place, others in
a per-thread scratch buffer, copied out as they are verified."""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ..._safe_load import torch_load
from ...errors import CheckpointCorruptedError
from ...integrity import ItemSum
from ...storage.buffers import aligned
from .verify import ChunkVerifier, check_layout, frame_matches, mismatch, read_exact
from .zipformat import chunk_layout, head_layout

__all__ = ["ChunkGroup", "read_stored", "release_scratch"]

Resolve = Callable[[ReadItem], torch.Tensor]


@dataclass
class ChunkGroup:
    """The planned reads of one stored item (a tensor chunk)."""

    info: _StorageInfo
    reads: List[ReadItem]
    #: the chunk's size and dtype as the metadata records them (None: not recorded)
    stored: Optional[Tuple[Tuple[int, ...], torch.dtype]] = None


def _pairs(
    stored: torch.Tensor, row0: int, group: ChunkGroup, resolve: Resolve, what: str
) -> List[Tuple[torch.Tensor, torch.Tensor, int]]:
    """`(source view, destination, first stored row)` of each read; `stored`: rows `row0...`."""
    out = []
    for r in group.reads:
        try:
            src = stored
            for dim, (o, n) in enumerate(zip(r.storage_offsets, r.lengths)):
                src = src.narrow(dim, o - (row0 if dim == 0 else 0), n)
        except (RuntimeError, IndexError) as e:
            raise CheckpointCorruptedError(
                f"{what}: stored chunk shape {tuple(stored.shape)} does not match metadata"
            ) from e
        dest = resolve(r)
        if dest.shape != src.shape:
            raise CheckpointCorruptedError(
                f"{what}: region shape {tuple(src.shape)} != destination {tuple(dest.shape)}"
            )
        out.append((src, dest, int(r.storage_offsets[0]) if r.storage_offsets else 0))
    return out


def _scatter(
    pairs: List[Tuple[torch.Tensor, torch.Tensor, int]],
    row0: int,
    nrows: int,
    row_bytes: int,
    skip: int,
) -> Callable[[int], None]:
    """A `consume` callback: copies each read's rows out as soon as they are verified (still
    in the CPU caches); the region starts `skip` bytes before row `row0`."""
    done = 0  # rows (from row0) already copied

    def copy_ready(ready: int) -> None:
        nonlocal done
        rows = min(nrows, max(0, ready - skip) // row_bytes)
        for src, dest, first in pairs:
            a, b = max(row0 + done, first), min(row0 + rows, first + src.shape[0])
            if a < b:
                dest.narrow(0, a - first, b - a).copy_(src.narrow(0, a - first, b - a))
        done = max(done, rows)

    return copy_ready


def read_stored(
    stream: io.BufferedReader,
    group: ChunkGroup,
    resolve: Resolve,
    what: str,
    expected: Optional[ItemSum],
    path: str,
    request: int,
) -> int:
    """Reads the rows of one stored chunk that `group`'s reads touch into their destinations
    (widened to whole checksum blocks; whole items for whole-item digests and for non-plain
    chunks, which go through `torch.load`); returns the bytes read from storage."""
    raw, info = stream.raw, group.info
    layout = _parse_chunk(raw, group, expected, what)
    if layout is None:
        return _load_whole(stream, group, resolve, what, expected)
    shape = layout.shape
    nrows = shape[0] if shape else 0
    row0, row1 = 0, nrows
    if (expected is None or expected.blocked) and nrows > 0:
        row0 = min(int(r.storage_offsets[0]) for r in group.reads)
        row1 = max(int(r.storage_offsets[0]) + int(r.lengths[0]) for r in group.reads)
    row_bytes = (math.prod(shape[1:]) if shape else 1) * layout.dtype.itemsize
    data_file_off = info.offset + layout.data_offset
    whole = (row0, row1) == (0, nrows)
    start, stop = (row0 * row_bytes, row1 * row_bytes) if shape else (0, layout.nbytes)
    dest = resolve(group.reads[0]) if len(group.reads) == 1 and (whole or row1 > row0) else None
    if dest is not None and _in_place(group.reads[0], dest, layout, row0, row1):
        verifier = ChunkVerifier(raw, layout, dest, start, info, expected, what)
        verifier.read(path, data_file_off + start, request)
        nread = stop - start + verifier.extra_bytes
    else:
        if expected is not None and not whole:  # widen to whole checksum blocks
            start -= start % expected.block
            stop = min(layout.nbytes, aligned(stop, expected.block))
        region = _scratch(stop - start)
        skip = row0 * row_bytes - start
        if shape:
            nbytes = (row1 - row0) * row_bytes
            stored = region[skip : skip + nbytes].view(layout.dtype).view((row1 - row0, *shape[1:]))
        else:  # a 0-d tensor
            stored = region.view(layout.dtype).view(())
        pairs = _pairs(stored, row0, group, resolve, what)
        streamed = len(shape) >= 1 and row_bytes > 0 and (expected is None or expected.blocked)
        scatter = _scatter(pairs, row0, row1 - row0, row_bytes, skip) if streamed else None
        verifier = ChunkVerifier(raw, layout, region, start, info, expected, what, scatter)
        verifier.read(path, data_file_off + start, request)
        if scatter is None:  # one digest for the whole item: copy once it is verified
            for src, dest, _ in pairs:
                dest.copy_(src)
        nread = stop - start
    # the frame is checked after the data so the item is read front to back
    if expected is not None and expected.blocked:
        if not frame_matches(raw, layout, info.length, expected):
            raise mismatch(what, info)
    return nread


def _load_whole(
    stream: io.BufferedReader,
    group: ChunkGroup,
    resolve: Resolve,
    what: str,
    expected: Optional[ItemSum],
) -> int:
    """Reads a chunk that is not plain through `torch.load` of its whole item."""
    stream.seek(0)
    payload = stream.read()
    if expected is not None and not expected.matches_whole(payload):
        raise mismatch(what, group.info)
    stored = torch_load(io.BytesIO(payload), what)
    if not isinstance(stored, torch.Tensor):
        raise CheckpointCorruptedError(f"{what}: expected a tensor, got {type(stored).__name__}")
    for src, dest, _ in _pairs(stored, 0, group, resolve, what):
        dest.copy_(src)
    return len(payload)


def _parse_chunk(raw: Any, group: ChunkGroup, expected: Optional[ItemSum], what: str) -> Any:
    """The chunk's `ChunkLayout` (None: not plain; `torch.load` reads it), checked against the
    metadata first; from the records before the data alone with per-block checksums."""
    layout = None
    if expected is not None and expected.blocked:
        layout = head_layout(
            read_exact(raw, 0, expected.data_off), expected.data_off, expected.data_len
        )
    if layout is None:
        layout = chunk_layout(raw)
    if layout is not None:
        check_layout(layout, group.stored, what)
    return layout


def _in_place(r: ReadItem, dest: torch.Tensor, layout: Any, row0: int, row1: int) -> bool:
    """Whether `r` is whole rows `row0:row1` into a contiguous host tensor of the stored dtype."""
    shape = tuple(layout.shape)
    want = (row1 - row0, *shape[1:]) if shape else ()
    return (
        [int(o) for o in r.storage_offsets] == ([row0] + [0] * (len(shape) - 1) if shape else [])
        and tuple(r.lengths) == want
        and tuple(dest.shape) == want
        and dest.dtype == layout.dtype
        and dest.is_contiguous()
        and dest.device.type == "cpu"
    )


_scratch_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """A per-thread reusable byte buffer (fresh memory page-faults), valid until the next."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        _scratch_local.buf = buf
    return buf[:nbytes]


def release_scratch() -> None:
    """Drops this thread's scratch buffer (none is kept after a load)."""
    _scratch_local.buf = None
