"""Stored chunks that several ranks of a node need strided parts of, read once per node.

A column block of a row-major chunk is a short run of every row, so each of the node's
ranks loading column blocks needs bytes from every page of the chunk. Read through the
page cache, the node fills the cache at its (slow) rate and every rank hashes and copies
every page; with this module one rank reads each such chunk with O_DIRECT, in 4 MiB
windows (8 MiB on a node of two ranks: `window_for`), into its shared-memory segment
(`storage.node_share`), verifies it there, and
every rank that needs the chunk copies its part out of the window.

The protocol, all of it decided from one exchange of every rank's offer (`offer`, then
`Offering.settle`; the `torch_dist` load sends it with its read-path measurement):
- Each rank offers the chunks it needs a strided part of (whole rows of it needed by the
  node together), with its node, pid and segment.
- Every rank of a node computes the same schedule from the offers: a chunk offered by
  `MIN_CONSUMERS` or more ranks of the node is shared; its file is read by one of them
  (files given out in turn to the rank with the fewest bytes so far, so that each file is
  read front to back by one rank); a reader reads its chunks in file order, window after
  window, into its `SLOTS` windows in turn.
- A reader's O_DIRECT reads land in private staging buffers, `AHEAD` windows ahead (in
  huge pages where the kernel gives them, `storage.buffers.staging`), and are copied into
  the shared window piece by piece (verified as each piece lands): shared memory gets
  4 KiB pages only, and direct reads into those ran at half the disk's rate on our VMs.
  Buffered reads (where O_DIRECT is refused) go straight into the windows.
- A consumer takes the windows it needs in one order shared by the node (by the reader's
  window number, then reader: `_order`), and frees each window once copied. A reader
  refills a window only once every consumer of what it held freed it. Consumers all going
  in the same order, one that keeps each reader's own, is what keeps this free of
  deadlocks: the earliest window anyone waits for has a reader that waits for no one.
- Rows that straddle two windows are completed by the reader, which copies the part in
  the previous window in front of the next (`PRE` bytes of room): every window holds
  whole rows.
- The reader verifies each checksum block as its bytes arrive and the chunk's zip
  records after its last window. Where the checksums record the data region (our own
  checkpoints), the records come with the first and last windows (`_WindowRecords`),
  not from reads of their own. A window is handed out before the block that straddles
  its end is complete (that block is checked with the next window): a mismatch fails the
  load on every rank before it returns, like every other verification failure.
- A rank that fails marks its segment, and its peers stop waiting for it (see
  `storage.node_share.wait`); the load's final agreement then raises everywhere.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import logging
import math
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ..._dist import get_collective_timeout, get_rank, get_world_size
from ...errors import CheckpointCorruptedError
from ...integrity import Checksums, ItemSum
from ...storage import buffers, faults, node_share
from ...storage.direct import open_for_reads
from ...storage.inflight import read_upto, request_pool
from ...storage.threads import local_ranks
from .reader import ChunkGroup, open_range, parse_chunk, strided
from .verify import BlockCheck, check_layout, frame_matches, mismatch, records_match
from .zipformat import head_layout

__all__ = ["Offering", "SharedReads", "offer", "window_for", "WINDOW", "SLOTS", "PRE"]

logger = logging.getLogger(__name__)

#: bytes per window read. Windows are small and the reads large in number (`AHEAD` in
#: flight): the node's segments, which every rank faults in, reserves and removes on each
#: load, are then a quarter of their former size. 4 ranks x 1 GiB column loads, alternating
#: A/B in one world: 0.49-0.57 s (median 0.53) with 4 MiB windows, 2 slots and 4 reads
#: ahead, against 0.57-1.01 s (median 0.62) with 16 MiB windows, 3 slots and 1 read ahead;
#: at 2 ranks both took 0.56 s (docs/performance.md, fourteenth pass). A chunk is cut into
#: windows of equal size up to `window + SLACK`, so that a 4 MiB piece and the zip records
#: around it are one read, not a full window and a few kilobytes. Nodes of two ranks use
#: windows twice as large (`window_for`).
WINDOW = 4 << 20
SLACK = 1 << 20
#: windows per rank: one being filled while the other is copied out (the reader copies the
#: start of a straddling row from the previous window: at least two)
SLOTS = 2
#: room in front of each window: the reader's header (`HEADER` bytes: whether the chunk
#: has the plain layout, and where its data starts), then the part of a row that began in
#: the previous window; rows longer than `PRE - HEADER` are not shared
PRE = 1 << 20
HEADER = 4096
#: smaller chunks are read the ordinary way (the protocol's waits would cost more)
MIN_SHARED = 1 << 20
#: ranks of a node that must need a chunk for it to be shared; two already gain (2 ranks x
#: 1 GiB column loads, alternating A/B: 0.47-0.52 s shared, 0.56-1.03 s not, with windows
#: filled from huge pages; before that, 0.96-1.12 s shared against 0.84-0.91 s not, and this
#: was 3; docs/performance.md, tenth and eleventh passes)
MIN_CONSUMERS = 2
#: bytes a reader copies from its staging buffer into a window at a time, each piece
#: verified while still in the cache
LAND = 1 << 20
#: windows a reader reads ahead into staging buffers while it copies one into the segment
AHEAD = 4

Key = Tuple[str, int, int]  # file (relative path), offset, length of a stored item


@dataclass(frozen=True)
class _Want:
    key: Key
    rows: Tuple[int, int]  # stored rows [start, stop) this rank reads
    stored: Tuple[Tuple[int, ...], torch.dtype]  # the chunk's shape and dtype (metadata)


@dataclass(frozen=True)
class _Offer:
    node: str
    pid: int
    segment: Optional[str]
    verify: bool
    window: int  # bytes per window (`window_for`): the node's ranks share only if equal
    wants: Tuple[_Want, ...]


@dataclass
class _Chunk:
    key: Key
    reader: int
    consumers: Tuple[int, ...]
    position: int  # in the reader's list
    first_window: int  # the reader's running window number at the chunk's start
    windows: int
    stored: Tuple[Tuple[int, ...], torch.dtype]
    window: int  # bytes per window (the node's)


def window_for(node_ranks: int) -> int:
    """Bytes per window on a node of `node_ranks` ranks: `WINDOW`, twice that for two.

    Every rank maps, faults in and unmaps the segments of all its node's ranks on each
    load, so small windows pay off as ranks grow; with two, larger reads won: 1 GiB column
    loads, alternating A/B in one world, medians of 6-8 loads (window MiB : slots : reads
    ahead), 2 ranks: 4:2:4 0.493 and 0.448 s, 8:2:4 0.451 and 0.421 s; 4 ranks: 4:2:4
    0.453 s, 8:2:4 0.493 s (docs/performance.md, fifteenth pass).
    """
    return 2 * WINDOW if node_ranks <= 2 else WINDOW


def _slot(window: int) -> int:
    """Bytes per slot of a segment with windows of `window` bytes."""
    return PRE + window + SLACK


def _windows(key: Key, window: int) -> int:
    start = key[1] - key[1] % mmap_page()
    return -(-(key[1] + key[2] - start) // (window + SLACK))


def mmap_page() -> int:
    """The page size: O_DIRECT offsets and lengths are multiples of it."""
    return os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _covers(ranges: List[Tuple[int, int]], nrows: int) -> bool:
    end = 0
    for a, b in sorted(ranges):
        if a > end:
            return False
        end = max(end, b)
    return end >= nrows


def _schedule(offers: List[_Offer], node: str) -> List[_Chunk]:
    """Every shared chunk of `node` (the same list on every rank of the node)."""
    ranks = [r for r, o in enumerate(offers) if o.node == node and o.segment is not None]
    if len(ranks) < 2 or len({(offers[r].verify, offers[r].window) for r in ranks}) > 1:
        return []
    window = offers[ranks[0]].window
    wanted: Dict[Key, List[Tuple[int, _Want]]] = {}
    for r in ranks:
        for w in offers[r].wants:
            wanted.setdefault(w.key, []).append((r, w))
    stored = {k: v[0][1].stored for k, v in wanted.items()}
    shared = {
        k: tuple(r for r, _ in v)
        for k, v in wanted.items()
        if len(v) >= max(2, MIN_CONSUMERS)
        and len({w.stored for _, w in v}) == 1
        and _covers([w.rows for _, w in v], v[0][1].stored[0][0])
    }
    by_file: Dict[str, List[Key]] = {}
    for k in sorted(shared):
        by_file.setdefault(k[0], []).append(k)
    assigned: Dict[int, int] = {r: 0 for r in ranks}
    streams: Dict[int, List[Key]] = {r: [] for r in ranks}
    for name in sorted(by_file):
        users = sorted({r for k in by_file[name] for r in shared[k]})
        reader = min(users, key=lambda r: (assigned[r], r))
        streams[reader] += by_file[name]
        assigned[reader] += sum(k[2] for k in by_file[name])
    chunks = []
    for reader, keys in streams.items():
        first = 0
        for pos, k in enumerate(keys):
            n = _windows(k, window)
            chunks.append(_Chunk(k, reader, shared[k], pos, first, n, stored[k], window))
            first += n
    return sorted(chunks, key=lambda c: (c.position, c.reader))


def _wants(groups: Dict[Key, ChunkGroup], checksums: Optional[Checksums]) -> List[_Want]:
    out = []
    for key, g in groups.items():
        if g.stored is None or len(g.stored[0]) < 2 or key[2] < MIN_SHARED:
            continue
        shape, dtype = g.stored
        if not strided(g) or not 0 < math.prod(shape[1:]) * dtype.itemsize <= PRE - HEADER:
            continue
        if checksums is not None:
            try:
                expected = checksums.expected_range(key[0], key[1], key[2], key[0])
            except CheckpointCorruptedError:
                continue  # reported by the ordinary read
            if expected is not None and not expected.blocked:
                continue
        first = min(int(r.storage_offsets[0]) for r in g.reads)
        last = max(int(r.storage_offsets[0]) + int(r.lengths[0]) for r in g.reads)
        out.append(_Want(key, (first, last), (tuple(int(n) for n in shape), dtype)))
    return out


def offer(
    groups: Optional[Dict[Key, ChunkGroup]],
    checksums: Optional[Checksums],
    enabled: bool,
) -> Offering:
    """This rank's offer of shared reads, before the exchange of every rank's offer: a
    collective step (every rank makes one and sends `Offering.offer` in the same exchange,
    then calls `Offering.settle` with all of them, or `Offering.discard` where the exchange
    failed). Never raises: the other ranks wait in the exchange.

    Args:
        groups: this rank's reads by stored item (None: it has nothing to read, e.g. its
            planning failed; it still takes part in the exchange).
        checksums: what reads are verified against (None: nothing verified).
        enabled: False to offer nothing (this rank reads everything itself).
    """
    own: Optional[node_share.Segment] = None
    wants: List[_Want] = []
    window = window_for(local_ranks(cuda_sources=False))
    try:
        if enabled and groups and get_world_size() > 1 and node_share.available():
            wants = _wants(groups, checksums)
            if wants:
                own = node_share.Segment.create(get_world_size(), SLOTS, _slot(window))
    except OSError as e:  # e.g. a full /dev/shm: this rank reads on its own
        logger.info("no shared reads on this rank: %s", e)
        wants, own = [], None
    except Exception as e:  # never before the exchange: the other ranks wait in it
        logger.warning("no shared reads on this rank: %s", e)
        wants, own = [], None
    return Offering(
        own,
        _Offer(
            node_share.node_id(),
            os.getpid(),
            own.path if own else None,
            checksums is not None,
            window,
            tuple(wants),
        ),
    )


@dataclass
class Offering:
    """This rank's offer (`offer`), to be exchanged, and its segment until `settle`."""

    own: Optional[node_share.Segment]
    offer: _Offer

    def settle(self, offers: List[_Offer]) -> Optional[SharedReads]:
        """Sets up this rank's part of the node's shared reads from every rank's offer
        (indexed by rank, this rank's among them).

        Returns:
            This rank's shared reads, or None when it takes part in none (its segment, if
            any, is removed).

        Raises:
            OSError, CheckpointingException: mapping a peer's segment failed (this rank's
                segment is marked failed first, so its peers stop).
        """
        own, rank, world = self.own, get_rank(), get_world_size()
        chunks = _schedule(offers, self.offer.node) if own is not None else []
        mine = [c for c in chunks if c.reader == rank or rank in c.consumers]
        if own is None or not mine:
            self.discard()
            return None
        shared = SharedReads(rank, world, own, [o.pid for o in offers], chunks)
        try:
            shared.attach([o.segment for o in offers])
        except BaseException:
            shared.fail()
            shared.close()
            shared.unlink()
            raise
        return shared

    def discard(self) -> None:
        """Removes this rank's segment (the offer was not exchanged, or not taken up)."""
        if self.own is not None:
            self.own.close()
            self.own.unlink()


@dataclass
class _Geometry:
    """Where a chunk's windows and rows lie in its file."""

    start: int  # file offset of window 0 (the item's offset, rounded down to a page)
    end: int  # the item's end
    size: int  # bytes per window (the last may be shorter)
    data: int  # file offset of the chunk's data (for chunks with the plain layout)
    row_bytes: int
    nrows: int

    def window(self, k: int) -> Tuple[int, int]:
        lo = self.start + k * self.size
        return lo, min(lo + self.size, self.end)

    def rows_before(self, offset: int) -> int:
        """Rows that end at or before file offset `offset`."""
        return max(0, min(self.nrows, (offset - self.data) // self.row_bytes))

    def rows(self, k: int) -> Tuple[int, int]:
        """The rows window `k` hands out: those that end in it."""
        lo, hi = self.window(k)
        return self.rows_before(lo), self.rows_before(hi)


class _ReadAhead:
    """A reader's reads ahead, across the ends of its chunks: the next `AHEAD` windows in
    the reader's order (`_Chunk.first_window`) are read with O_DIRECT into staging buffers
    (`AHEAD + 1`) on the process's request pool while the reader copies the last one into
    its shared window, so the disk does not idle while a chunk's last window is copied and
    the next chunk's zip records are parsed (4 ranks x 1 GiB column loads, 16 chunks of
    16 MiB per file, alternating A/B in two runs: medians 0.559 and 0.532 s, against 0.582
    and 0.559 s with reads ahead stopping at each chunk's end; docs/performance.md,
    fourteenth pass).

    Args:
        windows: `(path, file offset, bytes to read)` of each of the reader's windows, in
            order (bytes rounded up to the page).

    Files whose directory refused O_DIRECT (before, or now on opening) are read buffered:
    their windows are not read ahead but straight into the shared window (`read_into`).
    """

    def __init__(self, windows: List[Tuple[str, int, int]]) -> None:
        self.windows = windows
        self.stages: List[np.ndarray] = []  # made with the first read ahead
        # each file is opened with the first use of one of its windows and closed once its
        # last window was taken (a reader may have many files: one fd each at most briefly)
        self.last = {path: j for j, (path, _, _) in enumerate(windows)}
        self.files: Dict[str, Tuple[int, bool]] = {}  # open files: path -> (fd, O_DIRECT)
        self.kinds: Dict[str, bool] = {}  # path -> O_DIRECT, once opened
        self.pending: Deque[Tuple[int, Future]] = collections.deque()
        self.next = 0  # first window neither submitted nor skipped
        self.submitted = 0  # windows read ahead so far (picks their staging buffer)

    def direct(self, j: int) -> bool:
        """Whether window `j` is read with O_DIRECT (ahead, into a staging buffer).

        Raises:
            CheckpointCorruptedError: its file cannot be opened.
        """
        path = self.windows[j][0]
        if path not in self.kinds:
            self.files[path] = open_for_reads(path)
            self.kinds[path] = self.files[path][1]
        return self.kinds[path]

    def take(self, j: int) -> Tuple[int, np.ndarray]:
        """Window `j`'s read (bytes read, the staging buffer holding them); windows are
        taken in order, and the buffer is valid until the next `take`.

        Raises:
            OSError, CheckpointCorruptedError: the read failed (or the `faults` seam).
        """
        self._top_up()
        got_j, future = self.pending.popleft()
        assert got_j == j, (got_j, j)
        got, stage = future.result()
        self._done(j)
        self._top_up()
        return got, stage

    def read_into(self, j: int, view: memoryview) -> int:
        """Reads window `j` (of a buffered file) straight into `view`; returns bytes read."""
        path, offset, want = self.windows[j]
        faults.check("read", path, offset, want, False)
        got = read_upto(self.files[path][0], offset, view[:want])
        self._done(j)
        return got

    def _done(self, j: int) -> None:
        path = self.windows[j][0]
        if self.last[path] == j:  # no read of it is in flight: earlier ones were taken
            os.close(self.files.pop(path)[0])

    def _top_up(self) -> None:
        while len(self.pending) < AHEAD and self.next < len(self.windows):
            j = self.next
            if not self.direct(j):
                self.next += 1
                continue
            if not self.stages:
                size = max(n for _, _, n in self.windows)
                self.stages = [_stage(size) for _ in range(AHEAD + 1)]
            stage = self.stages[self.submitted % len(self.stages)]
            fd = self.files[self.windows[j][0]][0]
            self.pending.append((j, request_pool().submit(self._fetch, j, fd, stage)))
            self.next += 1
            self.submitted += 1

    def _fetch(self, j: int, fd: int, stage: np.ndarray) -> Tuple[int, np.ndarray]:
        path, offset, want = self.windows[j]
        faults.check("read", path, offset, want, True)
        return read_upto(fd, offset, memoryview(stage[:want])), stage  # type: ignore[arg-type]

    def close(self) -> None:
        """Waits for the reads in flight (they use the files and buffers), closes the files."""
        for _, f in self.pending:
            f.cancel()
        for _, f in self.pending:
            with contextlib.suppress(BaseException):
                f.result()
        self.pending.clear()
        for fd, _ in self.files.values():
            os.close(fd)
        self.files.clear()


class _Records(abc.ABC):
    """A shared chunk's zip records: where its data lies (from the records before it) and
    their check (with those after it) once the chunk's windows were read."""

    blocks: Optional[BlockCheck] = None

    @abc.abstractmethod
    def start(self, lo: int, read: np.ndarray) -> Tuple[_Geometry, Optional[BlockCheck]]:
        """The chunk's geometry and block check, given its first window (`read`, the bytes
        read at file offset `lo`)."""

    @abc.abstractmethod
    def take(self, lo: int, read: np.ndarray) -> None:
        """Takes what it needs of each window's bytes (`read`, read at file offset `lo`)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Checks every block and the records' digest (after the chunk's last window).

        Raises:
            CheckpointCorruptedError: they do not match.
        """


class _ReadRecords(_Records):
    """The records read on their own, through the item's stream (`raw`): for chunks
    whose data region the checksums do not record, or which nothing verifies."""

    def __init__(
        self,
        chunk: _Chunk,
        raw: Any,
        expected: Optional[ItemSum],
        what: str,
        info: _StorageInfo,
    ) -> None:
        self.chunk, self.raw, self.expected, self.what, self.info = chunk, raw, expected, what, info
        self.layout = parse_chunk(raw, None, expected, what)
        if self.layout is not None:
            check_layout(self.layout, chunk.stored, what)

    def start(self, lo: int, read: np.ndarray) -> Tuple[_Geometry, Optional[BlockCheck]]:
        layout, expected = self.layout, self.expected
        geo = _geometry(
            self.chunk.key,
            self.chunk.window,
            layout.data_offset if layout is not None else None,
            self.chunk.stored,
        )
        if expected is not None and expected.blocked and layout is not None:
            self.blocks = BlockCheck(expected, self.what, self.info)
        return geo, self.blocks

    def take(self, lo: int, read: np.ndarray) -> None:
        pass  # the records were read through `raw`

    def finish(self) -> None:
        if self.blocks is None:
            return
        assert self.expected is not None and self.layout is not None
        self.blocks.finish()
        if not frame_matches(self.raw, self.layout, self.chunk.key[2], self.expected):
            raise mismatch(self.what, self.info)


class _WindowRecords(_Records):
    """The records taken from the chunk's own windows as they pass, for items whose data
    region the checksums record (`ItemSum.blocked`): no read of their own through the page
    cache, which took 5-11 ms a chunk (0.08-0.18 s of a 2-rank x 1 GiB column load) while
    the reader's stream waited. A/B, 8 loads each, medians: 0.479 s against 0.496 s at
    2 ranks x 1 GiB, 0.483 s against 0.503 s at 4 ranks (docs/performance.md, fifteenth
    pass)."""

    def __init__(self, chunk: _Chunk, expected: ItemSum, what: str, info: _StorageInfo) -> None:
        self.chunk, self.expected, self.what, self.info = chunk, expected, what, info
        offset, length = chunk.key[1], chunk.key[2]
        self.head = b""
        self.tail = bytearray()
        self.tail_at = offset + expected.data_off + expected.data_len
        self.end = offset + length
        self.plain = False

    @staticmethod
    def fits(chunk: _Chunk, expected: Optional[ItemSum]) -> bool:
        """Whether the chunk's records before its data lie in its first window."""
        if expected is None or not expected.blocked:
            return False
        geo = _geometry(chunk.key, chunk.window, None, chunk.stored)
        return chunk.key[1] - geo.start + expected.data_off <= geo.window(0)[1] - geo.start

    def start(self, lo: int, read: np.ndarray) -> Tuple[_Geometry, Optional[BlockCheck]]:
        e, key = self.expected, self.chunk.key
        at = key[1] - lo
        self.head = read[at : at + e.data_off].tobytes()
        layout = head_layout(self.head, e.data_off, e.data_len)
        if layout is None or layout.data_offset != e.data_off or layout.nbytes != e.data_len:
            # not the plain layout: its consumers read it the ordinary way
            return _geometry(key, self.chunk.window, None, self.chunk.stored), None
        check_layout(layout, self.chunk.stored, self.what)
        self.plain = True
        self.blocks = BlockCheck(e, self.what, self.info)
        return _geometry(key, self.chunk.window, layout.data_offset, self.chunk.stored), self.blocks

    def take(self, lo: int, read: np.ndarray) -> None:
        a, b = max(lo, self.tail_at), min(lo + read.size, self.end)
        if b > a:
            self.tail += read[a - lo : b - lo].tobytes()

    def finish(self) -> None:
        if not self.plain:
            return
        assert self.blocks is not None
        self.blocks.finish()
        if len(self.tail) != self.end - self.tail_at or not records_match(
            self.head, self.tail, self.expected
        ):
            raise mismatch(self.what, self.info)


def _stage(nbytes: int) -> np.ndarray:
    """A staging buffer for one window: in huge pages where the kernel gives them, else in
    private pages (one path for every reader: without huge pages, 4 ranks x 1 GiB column
    loads through private buffers took 0.67-0.99 s against 0.67-1.05 s reading one window
    at a time straight into shared memory; docs/performance.md, fourteenth pass)."""
    stage = buffers.staging(nbytes)
    return stage if stage is not None else buffers.private(nbytes)


@dataclass
class SharedReads:
    """This rank's part of a node's shared reads (see the module docstring).

    Made by `Offering.settle`; `run` does the reads, `close` unmaps, `unlink` removes this rank's
    segment (after the load's last collective: peers map it until then).
    """

    rank: int
    world: int
    own: node_share.Segment
    pids: List[int]
    chunks: List[_Chunk]
    segments: List[Optional[node_share.Segment]] = field(default_factory=list)
    read_bytes: int = 0

    @property
    def keys(self) -> Set[Key]:
        """The items this rank gets through the shared reads (it reads none of them itself)."""
        return {c.key for c in self.chunks if self.rank in c.consumers}

    @property
    def _node_ranks(self) -> List[int]:
        return sorted(
            {c.reader for c in self.chunks} | {r for c in self.chunks for r in c.consumers}
        )

    def attach(self, names: Sequence[Optional[str]]) -> None:
        """Maps the segments of this rank's node peers in the schedule."""
        self.segments = [None] * self.world
        self.segments[self.rank] = self.own
        for r in self._node_ranks:
            if r != self.rank:
                name = names[r]
                assert name is not None
                self.segments[r] = node_share.Segment.attach(
                    name, self.world, SLOTS, _slot(self.chunks[0].window)
                )

    def fail(self) -> None:
        """Tells the node's peers this rank stopped."""
        with contextlib.suppress(Exception):
            self.own.mark_failed()

    def close(self) -> None:
        """Unmaps every segment (this rank's file stays until `unlink`)."""
        for seg in self.segments or [self.own]:
            if seg is not None:
                seg.close()

    def unlink(self) -> None:
        """Removes this rank's segment file."""
        self.own.unlink()

    def run(
        self,
        checkpoint_dir: Path,
        groups: Dict[Key, ChunkGroup],
        resolve: Callable[[ReadItem], torch.Tensor],
        checksums: Optional[Checksums],
        progress: Optional[Callable[[int], None]] = None,
    ) -> List[Key]:
        """Reads this rank's chunks for the node and copies out what this rank needs.

        Args:
            checkpoint_dir: the checkpoint.
            groups: this rank's reads by item (those in `keys` are done here).
            resolve: a read's destination view.
            checksums: what the reads are verified against.
            progress: called with the bytes of each chunk copied out.

        Returns:
            The items this rank still has to read itself (chunks whose zip records are
            not the plain layout: the windows were passed on without being used).

        Raises:
            CheckpointCorruptedError: a chunk this rank read or used is damaged.
            SharedReadAborted: a peer failed or died.
        """
        stop = threading.Event()
        errors: List[BaseException] = []
        check = node_share.peers_check(self.segments, self.pids, self._node_ranks)
        stall = get_collective_timeout()

        def checked() -> None:
            if stop.is_set():
                raise node_share.SharedReadAborted("stopped: this rank failed")
            check()

        def read_all() -> None:
            try:
                self._read(checkpoint_dir, checksums, checked, stall)
            except BaseException as e:
                errors.append(e)
                self.fail()

        reader = None
        if any(c.reader == self.rank for c in self.chunks):
            reader = threading.Thread(target=read_all, name="dc-shared-read", daemon=True)
            reader.start()
        try:
            left = self._consume(groups, resolve, checked, stall, progress)
        except BaseException as e:
            self.fail()
            stop.set()
            if reader is not None:
                reader.join()
            aborted = node_share.SharedReadAborted
            if errors and isinstance(e, aborted) and not isinstance(errors[0], aborted):
                raise errors[0] from e  # this rank's own reader failed first: the cause
            raise
        if reader is not None:
            reader.join()
        if errors:
            raise errors[0]
        return left

    # -- the reader's side --------------------------------------------------------------

    def _read(
        self,
        checkpoint_dir: Path,
        checksums: Optional[Checksums],
        check: Callable[[], None],
        stall: float,
    ) -> None:
        """Reads this rank's chunks, window by window, into its segment's windows."""
        mine = sorted((c for c in self.chunks if c.reader == self.rank), key=lambda c: c.position)
        if not mine:
            return
        page = mmap_page()
        windows = []
        for chunk in mine:  # where each window lies does not depend on the chunk's layout
            path = str(checkpoint_dir / chunk.key[0])
            geo = _geometry(chunk.key, chunk.window, None, chunk.stored)
            for k in range(chunk.windows):
                lo, hi = geo.window(k)
                windows.append((path, lo, -(-(hi - lo) // page) * page))
        ahead = _ReadAhead(windows)
        try:
            self._read_chunks(mine, checkpoint_dir, checksums, check, stall, ahead)
        finally:
            ahead.close()

    def _read_chunks(
        self,
        mine: List[_Chunk],
        checkpoint_dir: Path,
        checksums: Optional[Checksums],
        check: Callable[[], None],
        stall: float,
        ahead: _ReadAhead,
    ) -> None:
        held: List[Tuple[int, ...]] = [()] * SLOTS  # consumers of what each window holds
        for chunk in mine:
            name, offset, length = chunk.key
            path = checkpoint_dir / name
            what = f"{name}@{offset} (shared read)"
            expected = (
                checksums.expected_range(name, offset, length, what)
                if checksums is not None
                else None
            )
            info = _StorageInfo(name, offset, length)
            if _WindowRecords.fits(chunk, expected):
                assert expected is not None
                records: _Records = _WindowRecords(chunk, expected, what, info)
                self._read_windows(chunk, str(path), records, held, check, stall, ahead)
                records.finish()
                continue
            with open_range(path, info) as stream:
                records = _ReadRecords(chunk, stream.raw, expected, what, info)
                self._read_windows(chunk, str(path), records, held, check, stall, ahead)
                records.finish()

    def _read_windows(
        self,
        chunk: _Chunk,
        path: str,
        records: _Records,
        held: List[Tuple[int, ...]],
        check: Callable[[], None],
        stall: float,
        ahead: _ReadAhead,
    ) -> None:
        geo = _geometry(chunk.key, chunk.window, None, chunk.stored)  # where the windows lie
        blocks: Optional[BlockCheck] = None
        for k in range(chunk.windows):
            n = chunk.first_window + k  # the reader's window number: also `ahead`'s
            slot = n % SLOTS
            for c in held[slot]:  # every consumer of what the window holds is done
                node_share.wait(self.own.free_sem(c), check, stall, f"rank {c} to free a window")
            held[slot] = ()
            buf = self.own.window(slot)
            lo, hi = geo.window(k)
            stage: Optional[np.ndarray] = None
            if ahead.direct(n):
                got, stage = ahead.take(n)
            else:
                got = ahead.read_into(n, memoryview(buf[PRE:]))  # type: ignore[arg-type]
            if got < hi - lo:
                raise CheckpointCorruptedError(f"{path}: short read at offset {lo + got}")
            self.read_bytes += hi - lo
            read = stage[: hi - lo] if stage is not None else buf[PRE : PRE + hi - lo]
            if k == 0:  # the records before the data say where it lies, and its rows
                geo, blocks = records.start(lo, read)
            records.take(lo, read)
            # the header: whether the chunk has the plain layout, where its data starts
            buf[:16].view(np.int64)[:] = (1 if geo.row_bytes else 0, geo.data - chunk.key[1])
            if geo.row_bytes and k > 0:  # the start of a row that began in the last window
                first = geo.data + geo.rows(k)[0] * geo.row_bytes
                if first < lo:
                    prev = self.own.window((n - 1) % SLOTS)
                    carry = lo - first
                    end = PRE + geo.size
                    buf[PRE - carry : PRE] = prev[end - carry : end]
            # the chunk's data in this window, as offsets into it
            a = max(lo, geo.data) - lo
            b = min(hi, geo.data + geo.nrows * geo.row_bytes) - lo
            if stage is not None:
                _land(stage, buf[PRE : PRE + hi - lo], blocks, a, b)
            elif blocks is not None and b > a:
                blocks.feed(buf[PRE + a : PRE + b])
            for c in chunk.consumers:
                seg = self.segments[c]
                assert seg is not None
                node_share.post(seg.ready_sem(self.rank))
            held[slot] = chunk.consumers

    # -- the consumer's side ------------------------------------------------------------

    def _consume(
        self,
        groups: Dict[Key, ChunkGroup],
        resolve: Callable[[ReadItem], torch.Tensor],
        check: Callable[[], None],
        stall: float,
        progress: Optional[Callable[[int], None]],
    ) -> List[Key]:
        """Copies this rank's parts out of the windows of the chunks it needs, in the
        node's order; returns the chunks without the plain layout (not copied)."""
        left: List[Key] = []
        # per chunk being copied out: its reads and destinations, its name, its geometry
        # (from the header of its first window)
        state: Dict[Key, Tuple[List[Tuple[ReadItem, torch.Tensor]], str, _Geometry]] = {}
        for chunk, k in _order(self.chunks, self.rank):
            reader = self.segments[chunk.reader]
            assert reader is not None
            if k == 0:
                group = groups[chunk.key]
                pairs = [(r, resolve(r)) for r in group.reads]
                what = f"{chunk.key[0]}@{chunk.key[1]} ({group.reads[0].storage_index.fqn!r})"
            else:
                pairs, what, geo = state[chunk.key]
            node_share.wait(
                self.own.ready_sem(chunk.reader),
                check,
                stall,
                f"rank {chunk.reader} to read {what}",
            )
            window = reader.window((chunk.first_window + k) % SLOTS)
            if k == 0:
                plain, data_offset = (int(x) for x in window[:16].view(np.int64))
                geo = _geometry(
                    chunk.key, chunk.window, data_offset if plain else None, chunk.stored
                )
                state[chunk.key] = (pairs, what, geo)
            if geo.row_bytes:
                _copy_rows(window, geo, k, chunk.stored, pairs)
            del window
            node_share.post(reader.free_sem(self.rank))
            if k + 1 < chunk.windows:
                continue
            del state[chunk.key]
            if not geo.row_bytes:
                left.append(chunk.key)
            elif progress is not None:
                progress(
                    sum(int(math.prod(r.lengths)) for r, _ in pairs) * chunk.stored[1].itemsize
                )
        return left


def _order(chunks: List[_Chunk], rank: int) -> List[Tuple[_Chunk, int]]:
    """The windows `rank` consumes, as (chunk, window of the chunk), in the node's one
    order: by the reader's window number, then reader. Any order that keeps each reader's
    own order is free of deadlocks; this one takes the readers' windows in turn. Taking
    whole chunks in turn instead, a reader waited while the consumers copied out another
    reader's chunk: at 2 ranks x 1 GiB column loads the second reader spent 0.14-0.20 s of
    a 0.46-0.52 s load waiting for its windows to be freed, 0.05-0.08 s with this order.
    The load's median time moved within the noise (A/B, 8 loads each: 0.516 s against
    0.496 s at 2 ranks, 0.497 s against 0.503 s at 4), its slowest loads less (0.654 s
    against 0.512 s, 0.836 s against 0.524 s; docs/performance.md, fifteenth pass)."""
    mine = [
        (c.first_window + k, c.reader, c, k)
        for c in chunks
        if rank in c.consumers
        for k in range(c.windows)
    ]
    return [(c, k) for _, _, c, k in sorted(mine, key=lambda w: (w[0], w[1]))]


def _geometry(key: Key, window: int, data_offset: Optional[int], stored: Any) -> _Geometry:
    """A chunk's windows, and its rows where it has the plain layout (`data_offset` known)."""
    page = mmap_page()
    start, end = key[1] - key[1] % page, key[1] + key[2]
    size = -(-(end - start) // _windows(key, window) // page) * page
    if data_offset is None:
        return _Geometry(start, end, size, key[1], 0, 0)
    shape, dtype = stored
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    return _Geometry(start, end, size, key[1] + data_offset, row_bytes, shape[0])


def _land(
    stage: np.ndarray, window: np.ndarray, blocks: Optional[BlockCheck], a: int, b: int
) -> None:
    """Copies `stage` into `window` (its size) piece by piece, feeding bytes `a`-`b` of
    each piece to `blocks` right after it lands, while the piece is still in the cache."""
    for s in range(0, window.size, LAND):
        e = min(window.size, s + LAND)
        window[s:e] = stage[s:e]
        if blocks is not None and min(b, e) > max(a, s):
            blocks.feed(window[max(a, s) : min(b, e)])


def _copy_rows(
    window: np.ndarray,
    geo: _Geometry,
    k: int,
    stored: Tuple[Tuple[int, ...], torch.dtype],
    pairs: List[Tuple[ReadItem, torch.Tensor]],
) -> None:
    """Copies the rows window `k` hands out into the reads' destinations."""
    r0, r1 = geo.rows(k)
    if r1 <= r0:
        return
    shape, dtype = stored
    lo, _ = geo.window(k)
    at = PRE + geo.data + r0 * geo.row_bytes - lo
    nbytes = (r1 - r0) * geo.row_bytes
    rows = torch.from_numpy(window[at : at + nbytes]).view(dtype).view((r1 - r0,) + shape[1:])
    for r, dest in pairs:
        first, count = int(r.storage_offsets[0]), int(r.lengths[0])
        a, b = max(r0, first), min(r1, first + count)
        if a >= b:
            continue
        src = rows.narrow(0, a - r0, b - a)
        for dim in range(1, len(shape)):
            src = src.narrow(dim, int(r.storage_offsets[dim]), int(r.lengths[dim]))
        dest.narrow(0, a - first, b - a).copy_(src)
