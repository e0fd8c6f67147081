"""Whole chunks, or whole rows of them, of one data file read with O_DIRECT as one stream.

A chunk read straight into its destination used to be read on its own: its zip records
before the data through the page cache, its data in a few large O_DIRECT requests, its
records after the data through the page cache again. Every chunk thus started from an idle
disk and ended with one, and each of its small reads waited for the disk alone: at 4 ranks
x 1 GiB (16 chunks of 16 MiB per rank), a plain load's reads took 0.42-0.47 s where raw
O_DIRECT reads of the same files took 0.35-0.36 s (docs/performance.md, thirteenth pass).

Here every such chunk of a file is planned up front from the metadata and the checksums,
which record where each item's data region lies (`integrity.ItemSum`): its records before
the data, the blocks of data it needs (all of them, or those holding its rows) and its
records after the data. All of the file's ranges are then read as one pipeline of requests
(`storage.read_spans`), and each delivery is taken apart here, in file order:
- the records before the data are parsed (`zipformat.head_layout`) and checked against the
  metadata before any byte reaches the destination;
- data bytes are copied into the destination a megabyte at a time and hashed per checksum
  block right after the copy, while they are in the CPU caches (never a second pass);
  bytes of the first and last block outside the read's rows are hashed and dropped;
- the records after the data complete the frame digest.

Only items with per-block digests are streamed (our checkpoints; others have no recorded
data region). A chunk whose records are not the plain layout stops the stream before its
data: it and the chunks after it are read the ordinary way (`reader`), as they are when
O_DIRECT is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import CheckpointCorruptedError
from ...integrity import ItemSum
from ...storage import direct
from .verify import BlockCheck, check_layout, flat_bytes, mismatch, records_match
from .zipformat import head_layout

if TYPE_CHECKING:
    from .reader import ChunkGroup

__all__ = ["PIECE", "StreamItem", "plan_item", "read_stream"]

#: data bytes copied into the destination, then hashed, at a time: the hash reads them
#: from the CPU caches the copy left them in
PIECE = 1 << 20


class _NotPlain(Exception):
    """A streamed chunk's records are not the plain layout: read it the ordinary way."""


@dataclass
class StreamItem:
    """One chunk's part of a stream: where its ranges are and where its rows go.

    `a:b` are the read's bytes in the item's data region, `lo:hi` the same widened to whole
    checksum blocks (what is read and verified).
    """

    group: ChunkGroup
    what: str
    expected: ItemSum
    dest: np.ndarray
    a: int
    b: int
    lo: int
    hi: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    got: int = 0  # data bytes received from `lo`
    blocks: BlockCheck = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = BlockCheck(self.expected, self.what, self.group.info, self.lo, self.hi)

    @property
    def spans(self) -> List[Tuple[int, int]]:
        """`(file offset, length)` of the records before the data, the data read, and the
        records after it (in file order; empty ones left out)."""
        base, e = self.group.info.offset, self.expected
        data = base + e.data_off
        out = [
            (base, e.data_off),
            (data + self.lo, self.hi - self.lo),
            (data + e.data_len, self.group.info.length - e.data_off - e.data_len),
        ]
        return [s for s in out if s[1] > 0]

    @property
    def complete(self) -> bool:
        e = self.expected
        return (
            len(self.head) == e.data_off
            and self.got == self.hi - self.lo
            and len(self.tail) == self.group.info.length - e.data_off - e.data_len
        )

    def feed(self, at: int, data: memoryview) -> None:
        """Takes this item's bytes out of a delivery of `data` read at file offset `at`
        (deliveries come in file order, without gaps in what the item asked for)."""
        base, e = self.group.info.offset, self.expected
        head_end = base + e.data_off
        piece = self._take(at, data, base + len(self.head), head_end)
        if piece is not None:
            self.head += piece
            if len(self.head) == e.data_off:
                self._parse_head()
        piece = self._take(at, data, head_end + self.lo + self.got, head_end + self.hi)
        if piece is not None:
            if len(self.head) != e.data_off:
                raise CheckpointCorruptedError(f"{self.what}: data read before its records")
            self._data(piece)
        tail_at = head_end + e.data_len + len(self.tail)
        piece = self._take(at, data, tail_at, base + self.group.info.length)
        if piece is not None:
            self.tail += piece

    def _take(self, at: int, data: memoryview, start: int, stop: int) -> Optional[memoryview]:
        """The part of the delivery in `[start, stop)`, where `start` is the next byte this
        item expects there; None if the delivery holds none of it."""
        end = min(at + len(data), stop)
        if max(at, start) >= end:
            return None
        if at > start:
            raise CheckpointCorruptedError(f"{self.what}: bytes {start}-{at} were not read")
        return data[start - at : end - at]

    def finish(self) -> None:
        """Checks, once the item is complete, that every block of its range was verified and
        its zip records (before and after its data) against their digest."""
        self.blocks.finish()
        if not records_match(self.head, self.tail, self.expected):
            raise mismatch(self.what, self.group.info)

    def _parse_head(self) -> None:
        e = self.expected
        layout = head_layout(bytes(self.head), e.data_off, e.data_len)
        if layout is None or layout.data_offset != e.data_off or layout.nbytes != e.data_len:
            raise _NotPlain(self.what)
        check_layout(layout, self.group.stored, self.what)

    def _data(self, piece: memoryview) -> None:
        src = np.frombuffer(piece, dtype=np.uint8)
        for i in range(0, len(piece), PIECE):
            part = src[i : i + PIECE]
            pos = self.lo + self.got  # where `part` starts in the data region
            c0, c1 = max(pos, self.a), min(pos + len(part), self.b)
            if c0 < c1:
                self.dest[c0 - self.a : c1 - self.a] = part[c0 - pos : c1 - pos]
            self.blocks.feed(part)
            self.got += len(part)


def plan_item(
    group: ChunkGroup,
    resolve: Callable[[ReadItem], torch.Tensor],
    expected: Optional[ItemSum],
    what: str,
) -> Optional[StreamItem]:
    """The chunk's part of a stream, or None where it is read the ordinary way.

    Streamed: one read of whole rows (all of the chunk, or a range of its rows) into a
    contiguous host destination of the stored dtype and shape, of an item with per-block
    digests whose data region holds exactly the chunk's bytes (as the metadata records it).
    """
    if expected is None or not expected.blocked or group.stored is None or len(group.reads) != 1:
        return None
    shape, dtype = group.stored
    if not shape:
        return None
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    if row_bytes <= 0 or shape[0] * row_bytes != expected.data_len:
        return None
    r = group.reads[0]
    offsets = [int(o) for o in r.storage_offsets]
    lengths = tuple(int(n) for n in r.lengths)
    if len(offsets) != len(shape) or any(offsets[1:]) or lengths[1:] != tuple(shape[1:]):
        return None
    row0, row1 = offsets[0], offsets[0] + lengths[0]
    if not 0 <= row0 < row1 <= shape[0]:
        return None
    dest = resolve(r)
    if (
        tuple(dest.shape) != lengths
        or dest.dtype != dtype
        or not dest.is_contiguous()
        or dest.device.type != "cpu"
    ):
        return None
    a, b = row0 * row_bytes, row1 * row_bytes
    block = expected.block
    lo, hi = a - a % block, min(expected.data_len, -(-b // block) * block)
    return StreamItem(group, what, expected, flat_bytes(dest), a, b, lo, hi)


def read_stream(
    path: str,
    items: List[StreamItem],
    request: int,
    progress: Optional[Callable[[int], None]] = None,
    depth: int = direct.DEPTH,
) -> Tuple[int, int]:
    """Reads the items (chunks of file `path`, in file order) with O_DIRECT as one stream.

    Args:
        path: the data file.
        items: from `plan_item`, sorted by their offset in the file.
        request: bytes per read request.
        progress: called with each finished item's data bytes read.
        depth: requests in flight.

    Returns:
        `(data bytes read, items finished)`: fewer items than given where a chunk's records
        are not the plain layout, or O_DIRECT is refused (then the caller reads the others
        the ordinary way: their destinations may hold part of their bytes).

    Raises:
        CheckpointCorruptedError: a damaged or truncated item (naming its file and bytes).
    """
    state = {"next": 0, "bytes": 0}

    def deliver(at: int, data: memoryview) -> None:
        i = state["next"]
        end = at + len(data)
        while i < len(items) and items[i].group.info.offset < end:
            item = items[i]
            item.feed(at, data)
            if not item.complete:
                break  # the next item's bytes come after this one's
            item.finish()
            state["bytes"] += item.hi - item.lo
            if progress is not None:
                progress(item.hi - item.lo)
            i += 1
            state["next"] = i

    spans = [s for item in items for s in item.spans]
    try:
        whole = direct.read_spans(path, spans, deliver, request=request, depth=depth)
    except (_NotPlain, direct.DirectUnavailable):
        return state["bytes"], state["next"]
    if state["next"] < len(items):
        item = items[state["next"]]
        info = item.group.info
        raise CheckpointCorruptedError(
            f"{item.what}: {path} "
            + ("ends inside the item" if not whole else "was not read whole")
            + f" (bytes {info.offset}-{info.offset + info.length})"
        )
    return state["bytes"], state["next"]
