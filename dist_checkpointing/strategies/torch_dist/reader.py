"""Reading torch_dist data files: each needed stored chunk once, straight into its destination.

Data files `[<hint>]__<rank>_<n>.distcp` hold, back to back, a `torch.save` zip per tensor
chunk (see `zipformat`) and raw bytes per object; `.metadata` (see `metadata_file`) says
where each item lies. One read pipeline: a chunk's records are parsed, then the rows the
reads need are read with `storage.read_region` in large requests and verified block by
block against `checksums.json` as they land. A read of whole rows into a contiguous host
destination of the stored dtype (a whole chunk, or a row-resharded part) lands in place,
with O_DIRECT by default; any other read (column blocks, several regions of one chunk,
another dtype) lands in a per-thread scratch buffer through the page cache, which the ranks
of a node share, and is copied out as it is verified.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..._safe_load import torch_load
from ...errors import CheckpointCorruptedError
from ...integrity import Checksums, ItemSum
from ...storage import read_region
from .verify import (
    ChunkVerifier,
    RangeVerifier,
    Verifier,
    check_layout,
    flat_bytes,
    frame_matches,
    mismatch,
    read_exact,
)
from .zipformat import chunk_layout, head_layout

__all__ = [
    "ChunkGroup",
    "READ_REQUEST",
    "group_reads",
    "open_range",
    "parse_chunk",
    "read_byte_items",
    "read_tensor_items",
]

#: bytes per read request: two checksum blocks, so a request's bytes are verified while
#: they are still in the CPU caches
READ_REQUEST = 8 << 20


def _storage_info(metadata: Metadata, index: MetadataIndex) -> _StorageInfo:
    try:
        return metadata.storage_data[index]
    except KeyError as e:
        raise CheckpointCorruptedError(
            f"No storage location for {index.fqn!r} at {index.offset}"
        ) from e


def _read_range(checkpoint_dir: Path, info: _StorageInfo) -> bytes:
    path = checkpoint_dir / info.relative_path
    with open_range(path, info) as f:
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointCorruptedError(f"{path}: short read at offset {info.offset}")
    return data


class _FileRange(io.RawIOBase):
    """A read-only, seekable view of `length` bytes of an open file from `offset`."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b).cast("B")[:n])
        self._pos += got
        return got


@contextlib.contextmanager
def open_range(path: Path, info: _StorageInfo) -> Iterator[io.BufferedReader]:
    """Opens the byte range of one stored item, checking the file is long enough."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot read ({e})") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < info.offset + info.length:
            raise CheckpointCorruptedError(
                f"{path}: truncated: item at offset {info.offset} needs {info.length} bytes, "
                f"the file has {max(0, size - info.offset)} from there"
            )
        yield io.BufferedReader(_FileRange(f, info.offset, info.length), 1 << 24)


@dataclass
class ChunkGroup:
    """The planned reads of one stored item (a tensor chunk)."""

    info: _StorageInfo
    reads: List[ReadItem]
    #: the chunk's size and dtype as the metadata records them (None: not recorded)
    stored: Optional[Tuple[Tuple[int, ...], torch.dtype]] = None


def _stored_chunk(
    metadata: Metadata, index: MetadataIndex
) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata) or index.offset is None:
        return None
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(int(s) for s in chunk.sizes), md.properties.dtype
    return None


#: a stored item: its file (relative path), offset and length
ItemKey = Tuple[str, int, int]


def group_reads(metadata: Metadata, reads: Sequence[ReadItem]) -> Dict[ItemKey, ChunkGroup]:
    """The reads grouped by the stored item they read from.

    Raises:
        CheckpointCorruptedError: a read's item has no storage location.
    """
    groups: Dict[ItemKey, ChunkGroup] = {}
    for r in reads:
        info = _storage_info(metadata, r.storage_index)
        groups.setdefault(
            (str(info.relative_path), info.offset, info.length),
            ChunkGroup(info, [], _stored_chunk(metadata, r.storage_index)),
        ).reads.append(r)
    return groups


def read_tensor_items(
    checkpoint_dir: Path,
    metadata: Metadata,
    reads: Sequence[ReadItem],
    resolve: Callable[[ReadItem], torch.Tensor],
    thread_count: int = 2,
    checksums: Optional[Checksums] = None,
    direct_io: bool = True,
    progress: Optional[Callable[[int], None]] = None,
    first_file: int = 0,
) -> int:
    """Reads each needed stored chunk once and copies the requested regions out of it.

    Each data file is read front to back, its chunks in file order; several files are read
    at once, one thread each.

    Args:
        checkpoint_dir: the checkpoint directory.
        metadata: its DCP metadata.
        reads: planned reads (see `plan_tensor_reads`).
        resolve: returns the destination view for a read item.
        thread_count: files read in parallel.
        checksums: when given, every item read is verified against it.
        direct_io: read whole rows that land in place with O_DIRECT (where the file system
            allows it); False: through the page cache.
        progress: called with the bytes of each chunk read (from the reading threads).
        first_file: start with the file at this position (modulo the number of files) of
            the sorted files this rank reads, then go round: ranks that all read the same
            files (a resharded load) pass their rank, so each file is first read by one
            rank and comes to the others from the page cache.

    Returns:
        Tensor data bytes read from storage: a resharded load reads only the rows it
        needs (widened to whole checksum blocks when verifying), and counts only those.

    Raises:
        CheckpointCorruptedError: on a missing, truncated, malformed or (with `checksums`)
            damaged chunk, naming the file, key and byte range.
    """
    groups = group_reads(metadata, reads)

    def load_group(group: ChunkGroup) -> int:
        info = group.info
        what = f"{info.relative_path}@{info.offset} ({group.reads[0].storage_index.fqn!r})"
        expected = (
            checksums.expected_range(str(info.relative_path), info.offset, info.length, what)
            if checksums is not None
            else None
        )
        path = checkpoint_dir / info.relative_path
        with open_range(path, info) as f:
            nread = _read_stored(f, group, resolve, what, expected, str(path), direct_io)
        if progress is not None:
            progress(nread)
        return nread

    by_file: Dict[str, List[ChunkGroup]] = {}
    for g in sorted(groups.values(), key=lambda g: (str(g.info.relative_path), g.info.offset)):
        by_file.setdefault(str(g.info.relative_path), []).append(g)
    names = sorted(by_file)
    if names:
        k = first_file % len(names)
        names = names[k:] + names[:k]

    def load_file(name: str) -> int:
        try:
            return sum(load_group(g) for g in by_file[name])
        finally:
            _scratch_local.buf = None  # do not keep a chunk-sized buffer after the load

    if thread_count <= 1 or len(names) <= 1:
        return sum(load_file(name) for name in names)
    workers = min(thread_count, len(names))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dc-read") as pool:
        return sum(pool.map(load_file, names))


def _pairs(
    stored: torch.Tensor,
    row0: int,
    group: ChunkGroup,
    resolve: Callable[[ReadItem], torch.Tensor],
    what: str,
) -> List[Tuple[torch.Tensor, torch.Tensor, int]]:
    """`(source view, destination, first stored row)` of each read, shapes checked.

    `stored` holds the rows `row0...` of the stored chunk (its bytes may not be read yet).
    """
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


class _Scatter:
    """Copies each read's rows to its destination as soon as they are read and verified.

    Rows are copied request by request, while they are still in the CPU caches, rather than
    after the whole region is read (which would take the region through memory twice more).
    Called with the number of leading bytes of the region (starting `skip` bytes before row
    `row0` of the stored chunk) that are ready.
    """

    def __init__(
        self,
        pairs: List[Tuple[torch.Tensor, torch.Tensor, int]],
        row0: int,
        nrows: int,
        row_bytes: int,
        skip: int,
    ) -> None:
        self.pairs, self.row0, self.nrows = pairs, row0, nrows
        self.row_bytes, self.skip = row_bytes, skip
        self.done = 0  # rows (from row0) already copied

    def __call__(self, ready: int) -> None:
        rows = min(self.nrows, max(0, ready - self.skip) // self.row_bytes)
        if rows <= self.done:
            return
        lo, hi = self.row0 + self.done, self.row0 + rows
        for src, dest, first in self.pairs:
            a, b = max(lo, first), min(hi, first + src.shape[0])
            if a < b:
                dest.narrow(0, a - first, b - a).copy_(src.narrow(0, a - first, b - a))
        self.done = rows


def _read_stored(
    stream: io.BufferedReader,
    group: ChunkGroup,
    resolve: Callable[[ReadItem], torch.Tensor],
    what: str,
    expected: Optional[ItemSum],
    path: str,
    direct_io: bool = True,
) -> int:
    """Reads what the group needs of one stored chunk into the reads' destinations.

    Returns:
        The number of tensor data bytes read from storage (for chunks that go through
        `torch.load`, the whole item): a resharded read counts only the rows it read.

    The zip is parsed directly for a plain contiguous chunk (no `torch.load`) and its data
    read with `read_region`, verified request by request as it lands: only the rows the
    reads touch, widened to whole checksum blocks when the item has per-block digests (then
    only those blocks and the item's zip records are verified). Items with one digest for
    the whole item are read whole to be verified. Other chunks go through `torch.load`.
    """
    raw = stream.raw
    layout = parse_chunk(raw, group, expected, what)
    if layout is None:
        stream.seek(0)
        payload = stream.read()
        if expected is not None and not expected.matches_whole(payload):
            raise mismatch(what, group.info)
        stored = torch_load(io.BytesIO(payload), what)
        if not isinstance(stored, torch.Tensor):
            raise CheckpointCorruptedError(
                f"{what}: expected a tensor, got {type(stored).__name__}"
            )
        for src, dest, _ in _pairs(stored, 0, group, resolve, what):
            dest.copy_(src)
        return len(payload)
    shape = layout.shape
    nrows = shape[0] if shape else 0
    row0, row1 = 0, nrows
    if (expected is None or expected.blocked) and nrows > 0:
        row0 = min(int(r.storage_offsets[0]) for r in group.reads)
        row1 = max(int(r.storage_offsets[0]) + int(r.lengths[0]) for r in group.reads)
    row_bytes = (math.prod(shape[1:]) if shape else 1) * layout.dtype.itemsize
    nread = _read_data(
        raw, group, layout, resolve, what, expected, path, direct_io, row0, row1, nrows, row_bytes
    )
    # checked after the data so that the item is read front to back; a mismatch raises
    # before the load returns anything
    if expected is not None and expected.blocked:
        if not frame_matches(raw, layout, group.info.length, expected):
            raise mismatch(what, group.info)
    return nread


def parse_chunk(
    raw: Any, group: Optional[ChunkGroup], expected: Optional[ItemSum], what: str
) -> Any:
    """The layout of a stored chunk's zip (`zipformat.ChunkLayout`), or None where it is not
    the plain layout (such chunks go through `torch.load`).

    With per-block checksums the layout comes from the records before the data (read
    front to back); the records after it are verified once the data is read.

    Raises:
        CheckpointCorruptedError: the records say another shape or dtype than the
            metadata does for `group` (checked before any data is read into a
            destination: a damaged record; the frame digest is checked later).
    """
    layout = None
    if expected is not None and expected.blocked:
        layout = head_layout(
            read_exact(raw, 0, expected.data_off), expected.data_off, expected.data_len
        )
    if layout is None:
        layout = chunk_layout(raw)
    if layout is not None:
        check_layout(layout, group.stored if group is not None else None, what)
    return layout


def _in_place(
    r: ReadItem, dest: torch.Tensor, layout: Any, row0: int, row1: int, whole: bool
) -> bool:
    """Whether read `r` is rows `row0:row1` of the stored chunk, all of each row, into a
    contiguous host destination of the stored dtype (so its bytes are read straight in)."""
    shape = tuple(layout.shape)
    want = shape if whole else (row1 - row0,) + shape[1:]
    first = 0 if whole else row0
    return (
        [int(o) for o in r.storage_offsets] == ([first] + [0] * (len(shape) - 1) if shape else [])
        and tuple(r.lengths) == want
        and tuple(dest.shape) == want
        and dest.dtype == layout.dtype
        and dest.is_contiguous()
        and dest.device.type == "cpu"
    )


def _read_data(
    raw: Any,
    group: ChunkGroup,
    layout: Any,
    resolve: Callable[[ReadItem], torch.Tensor],
    what: str,
    expected: Optional[ItemSum],
    path: str,
    direct_io: bool,
    row0: int,
    row1: int,
    nrows: int,
    row_bytes: int,
) -> int:
    """Reads rows `row0:row1` of a parsed contiguous chunk into the reads' destinations: in
    place where one read takes whole rows into a contiguous destination, else through a
    scratch buffer in the page cache, scattered as verified (see the module docstring)."""
    shape = layout.shape
    data_file_off = group.info.offset + layout.data_offset
    whole = (row0, row1) == (0, nrows)
    if len(group.reads) == 1 and (whole or row1 > row0):
        dest = resolve(group.reads[0])
        if _in_place(group.reads[0], dest, layout, row0, row1, whole):
            a, b = (0, layout.nbytes) if whole else (row0 * row_bytes, row1 * row_bytes)
            verifier: Verifier
            if whole or expected is None:
                verifier = ChunkVerifier(raw, layout, dest, a, group.info, expected, what)
            else:
                verifier = RangeVerifier(
                    lambda off, n: read_exact(raw, layout.data_offset + off, n),
                    dest,
                    a,
                    group.info,
                    expected,
                    what,
                )
            _read_verified(path, data_file_off + a, dest, direct_io, verifier)
            return b - a + verifier.extra_bytes
    start, stop = row0 * row_bytes, row1 * row_bytes
    if expected is not None and not whole:  # widen to whole checksum blocks
        start = start - start % expected.block
        stop = min(layout.nbytes, -(-stop // expected.block) * expected.block)
    if whole:
        start, stop = 0, layout.nbytes
    region = _scratch(stop - start)
    skip = row0 * row_bytes - start
    if shape:
        rows = region[skip : skip + (row1 - row0) * row_bytes].view(layout.dtype)
        stored = rows.view((row1 - row0,) + tuple(shape[1:]))
    else:  # a 0-d tensor
        stored = region.view(layout.dtype).view(())
    pairs = _pairs(stored, row0, group, resolve, what)
    streamed = len(shape) >= 1 and row_bytes > 0 and (expected is None or expected.blocked)
    scatter = _Scatter(pairs, row0, row1 - row0, row_bytes, skip) if streamed else None
    verifier = ChunkVerifier(raw, layout, region, start, group.info, expected, what, scatter)
    _read_verified(path, data_file_off + start, region, False, verifier)
    if scatter is None:  # one digest for the whole item: copy once it is verified
        for src, dest, _ in pairs:
            dest.copy_(src)
    return stop - start


def _read_verified(
    path: str,
    offset: int,
    data: torch.Tensor,
    direct: bool,
    verifier: Verifier,
) -> None:
    """Reads `data`'s bytes from `offset`, verifying each request's bytes as they land."""
    read_region(
        path,
        offset,
        flat_bytes(data),
        direct=direct,
        progress=verifier if verifier.needed else None,
        request=READ_REQUEST,
    )
    verifier.finish()


_scratch_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """A per-thread reusable byte buffer (fresh memory would page-fault on every chunk).

    Valid until the same thread asks again: callers copy out of it before their next read.
    """
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        _scratch_local.buf = buf
    return buf[:nbytes]


def read_byte_items(
    checkpoint_dir: Path,
    metadata: Metadata,
    indices: Sequence[MetadataIndex],
    checksums: Optional[Checksums] = None,
) -> List[bytes]:
    """Reads raw byte items (serialized ShardedObjects) in the order of `indices`.

    Raises:
        CheckpointCorruptedError: a missing, truncated or (with `checksums`) damaged item.
    """
    out = []
    for index in indices:
        info = _storage_info(metadata, index)
        data = _read_range(checkpoint_dir, info)
        if checksums is not None:
            what = f"{info.relative_path}@{info.offset} ({index.fqn!r})"
            expected = checksums.expected_range(
                str(info.relative_path), info.offset, info.length, what
            )
            if expected is not None and not expected.matches_whole(data):
                raise mismatch(what, info)
        out.append(data)
    return out
