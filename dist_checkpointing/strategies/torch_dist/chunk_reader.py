"""Reading the bytes of one stored tensor chunk that its reads need, verified as they land.

A read (a box of offsets and lengths in the chunk) is a set of contiguous byte runs of the
chunk's C-contiguous data: one run when the dims after its first partial one are whole (rows
`[a, b)` of one layer of a layer-stacked tensor), else one per row. The runs of all reads of
a chunk are coalesced into spans (across gaps under a page and, when verifying per-block
digests, wherever they share a checksum block, so no block is read twice); each span is read
once, into its destination when it is exactly one contiguous host tensor of the stored
dtype, else into a per-thread scratch buffer from which each read is copied out once the
span is verified.

Trade-off taken: a byte returned is always a verified byte. A per-block digest (`.sums`)
covers 4 MiB of data, so a span's first and last blocks are completed by reading their
bytes outside the span (`ChunkVerifier`); an item with one digest over all its bytes is read
whole; a chunk that is not plain goes through `torch.load` of its whole item.
"""

from __future__ import annotations

import bisect
import io
import itertools
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
from .verify import ChunkVerifier, check_layout, frame_matches, mismatch, read_exact
from .zipformat import chunk_layout, head_layout

__all__ = ["ChunkGroup", "read_stored", "release_scratch"]

Resolve = Callable[[ReadItem], torch.Tensor]
Span = Tuple[int, int]

#: runs closer than this are read as one (the OS reads whole pages anyway)
_GAP = 4096
#: a read of more runs than this is read as one span from its first byte to its last (its
#: extent bounds it; planning stays cheap for column slices of huge tensors)
_MAX_RUNS = 4096


@dataclass
class ChunkGroup:
    """The planned reads of one stored item (a tensor chunk)."""

    info: _StorageInfo
    reads: List[ReadItem]
    #: the chunk's size and dtype as the metadata records them (None: not recorded)
    stored: Optional[Tuple[Tuple[int, ...], torch.dtype]] = None


class _Piece:
    """A box of the chunk (`offsets`, `lengths`) and its destination."""

    def __init__(
        self, offsets: List[int], lengths: List[int], dest: torch.Tensor, item: int, shape: Any
    ) -> None:
        self.offsets, self.lengths, self.dest, self.item = offsets, lengths, dest, item
        self.shape, self.strides = shape, [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        first = sum(o * s for o, s in zip(offsets, self.strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, self.strides))
        self.lo, self.hi = first * item, (last + 1) * item  # its bytes' extent in the data

    def runs(self) -> List[Span]:
        """Its contiguous byte runs (its whole extent beyond `_MAX_RUNS` of them)."""
        k = len(self.shape) - 1  # the dims after k are whole: a run is `lengths[k]` of those
        while k > 0 and self.offsets[k] == 0 and self.lengths[k] == self.shape[k]:
            k -= 1
        count = math.prod(self.lengths[:k]) if k > 0 else 1
        if count == 1 or count > _MAX_RUNS:
            return [(self.lo, self.hi)]
        run = self.lengths[k] * self.strides[k] * self.item
        out = []
        for idx in itertools.product(*(range(n) for n in self.lengths[:k])):
            first = sum((o + i) * s for o, i, s in zip(self.offsets, idx, self.strides))
            first = (first + self.offsets[k] * self.strides[k]) * self.item
            out.append((first, first + run))
        return out

    def split(self) -> List[_Piece]:
        """One piece per index along its first dim longer than one (a piece of one element
        is one run, always inside one span)."""
        d = next(d for d, n in enumerate(self.lengths) if n > 1)
        out = []
        for i in range(self.lengths[d]):
            o, n = list(self.offsets), list(self.lengths)
            o[d], n[d] = o[d] + i, 1
            out.append(_Piece(o, n, self.dest.narrow(d, i, 1), self.item, self.shape))
        return out

    def lands_in_place(self, dtype: torch.dtype, a: int, b: int) -> bool:
        """Whether it is exactly bytes `[a, b)` into a contiguous host tensor of `dtype`."""
        return (
            (self.lo, self.hi) == (a, b)
            and b - a == math.prod(self.lengths) * self.item
            and self.dest.dtype == dtype
            and self.dest.is_contiguous()
            and self.dest.device.type == "cpu"
        )

    def copy_from(self, typed: torch.Tensor, start: int) -> None:
        """Copies its box out of `typed`: the span's bytes (from data offset `start`) typed."""
        offset = typed.storage_offset() + (self.lo - start) // self.item
        self.dest.copy_(typed.as_strided(self.lengths, self.strides, offset))


def _pieces(group: ChunkGroup, resolve: Resolve, layout: Any, what: str) -> List[_Piece]:
    """One piece per read with anything to copy; raises where a read does not fit."""
    shape = tuple(layout.shape)
    out = []
    for r in group.reads:
        offsets = [int(o) for o in r.storage_offsets]
        lengths = [int(n) for n in r.lengths]
        if len(offsets) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)
        ):
            raise CheckpointCorruptedError(
                f"{what}: stored chunk shape {shape} does not match metadata (a read of "
                f"{lengths} at {offsets})"
            )
        dest = resolve(r)
        if tuple(dest.shape) != tuple(lengths):
            raise CheckpointCorruptedError(
                f"{what}: region shape {tuple(lengths)} != destination {tuple(dest.shape)}"
            )
        if math.prod(lengths) > 0:
            out.append(_Piece(offsets, lengths, dest, layout.dtype.itemsize, shape))
    return out


def _spans(runs: List[Span], block: int) -> List[Span]:
    """Runs coalesced across gaps under `_GAP` and (with `block`) within a shared block."""
    out: List[List[int]] = []
    for a, b in sorted(runs):
        if out and (a - out[-1][1] < _GAP or (block and a // block <= (out[-1][1] - 1) // block)):
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _fit(pieces: List[_Piece], spans: List[Span]) -> List[List[_Piece]]:
    """The pieces of each span, split until each lies inside one span."""
    starts = [a for a, _ in spans]
    members: List[List[_Piece]] = [[] for _ in spans]
    todo = list(pieces)
    while todo:
        p = todo.pop()
        i = bisect.bisect_right(starts, p.lo) - 1
        if i >= 0 and p.hi <= spans[i][1]:
            members[i].append(p)
        else:
            todo.extend(p.split())
    return members


def read_stored(
    stream: io.BufferedReader,
    group: ChunkGroup,
    resolve: Resolve,
    what: str,
    expected: Optional[ItemSum],
    path: str,
    request: int,
) -> int:
    """Reads the bytes of one stored chunk that `group`'s reads need into their destinations
    (completed to whole checksum blocks; whole items for whole-item digests and for non-plain
    chunks); returns the bytes read from storage."""
    raw, info = stream.raw, group.info
    layout = _parse_chunk(raw, group, expected, what)
    if layout is None:
        return _load_whole(stream, group, resolve, what, expected)
    pieces = _pieces(group, resolve, layout, what)
    if not pieces:
        return 0
    if expected is not None and not expected.blocked:  # verified at its last byte: read whole
        spans = [(0, layout.nbytes)]
    else:
        spans = _spans([r for p in pieces for r in p.runs()], expected.block if expected else 0)
    nread = 0
    for (a, b), members in zip(spans, _fit(pieces, spans)):
        # a span that is exactly one destination lands in it, else in scratch copied out
        in_place = len(members) == 1 and members[0].lands_in_place(layout.dtype, a, b)
        data = members[0].dest if in_place else _scratch(b - a).view(layout.dtype)
        verifier = ChunkVerifier(raw, layout, data, a, info, expected, what)
        verifier.read(path, info.offset + layout.data_offset + a, request)
        if not in_place:
            for p in members:
                p.copy_from(data, a)
        nread += b - a + verifier.extra_bytes
    # the frame is checked after the data so the item is read front to back
    if (
        expected is not None
        and expected.blocked
        and not frame_matches(raw, layout, info.length, expected)
    ):
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
    for r in group.reads:
        src = stored
        try:
            for dim, (o, n) in enumerate(zip(r.storage_offsets, r.lengths)):
                src = src.narrow(dim, o, n)
        except (RuntimeError, IndexError) as e:
            raise CheckpointCorruptedError(
                f"{what}: stored chunk shape {tuple(stored.shape)} does not match metadata"
            ) from e
        dest = resolve(r)
        if dest.shape != src.shape:
            raise CheckpointCorruptedError(
                f"{what}: region shape {tuple(src.shape)} != destination {tuple(dest.shape)}"
            )
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
