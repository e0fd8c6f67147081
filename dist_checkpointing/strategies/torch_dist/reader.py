"""Reading torch_dist data files `[<hint>]__<rank>_<n>.distcp` (a `torch.save` zip per tensor
chunk, raw bytes per object): each needed stored chunk once (`chunk_reader`), straight into
its destinations, each file front to back by one thread."""

from __future__ import annotations

import contextlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import CheckpointCorruptedError
from ...integrity import Checksums
from ...storage import objstore
from ...storage.fileio import RangeFile
from .chunk_reader import ChunkGroup, read_stored, release_scratch
from .verify import mismatch

__all__ = ["READ_REQUEST", "open_range", "read_byte_items", "read_tensor_items"]

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


@contextlib.contextmanager
def open_range(path: Path, info: _StorageInfo) -> Iterator[io.BufferedReader]:
    """Opens the byte range of one stored item, checking the file is long enough."""
    if objstore.split(path) is not None:  # an object: ranged GETs
        yield io.BufferedReader(RangeFile(path, info.offset, info.length), 1 << 16)
        return
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
        yield io.BufferedReader(RangeFile(f, info.offset, info.length), 1 << 24)


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


def _group_reads(metadata: Metadata, reads: Sequence[ReadItem]) -> Dict[str, List[ChunkGroup]]:
    """The reads grouped by the stored item they read from (which must have a location), the
    items by file, in file order."""
    groups: Dict[Tuple[str, int, int], ChunkGroup] = {}  # by file, offset, length
    for r in reads:
        info = _storage_info(metadata, r.storage_index)
        key = (str(info.relative_path), info.offset, info.length)
        if key not in groups:
            groups[key] = ChunkGroup(info, [], _stored_chunk(metadata, r.storage_index))
        groups[key].reads.append(r)
    by_file: Dict[str, List[ChunkGroup]] = {}
    for key in sorted(groups):
        by_file.setdefault(key[0], []).append(groups[key])
    return by_file


def _what(info: _StorageInfo, fqn: str) -> str:
    return f"{info.relative_path}@{info.offset} ({fqn!r})"


def _expected(checksums: Optional[Checksums], info: _StorageInfo, what: str) -> Any:
    if checksums is None:
        return None
    return checksums.expected_range(str(info.relative_path), info.offset, info.length, what)


def read_tensor_items(
    checkpoint_dir: Path,
    metadata: Metadata,
    reads: Sequence[ReadItem],
    resolve: Callable[[ReadItem], torch.Tensor],
    thread_count: int = 2,
    checksums: Optional[Checksums] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> int:
    """Reads each needed stored chunk once into the regions `resolve` gives, each file front
    to back by one thread, `thread_count` files at once, in name order (ranks that read the
    same files read them at the same time: one from storage, the others from the page cache
    while it is there); returns the tensor bytes read from storage (only the rows needed,
    widened to whole checksum blocks when verifying).

    Args:
        checksums: when given, every item read is verified against it.
        progress: called with the bytes of each chunk read (from the reading threads).

    Raises:
        CheckpointCorruptedError: a missing, truncated, malformed or damaged chunk (named).
    """
    by_file = _group_reads(metadata, reads)
    request = READ_REQUEST  # read at call time: tests make it small

    def load_group(group: ChunkGroup) -> int:
        info = group.info
        what = _what(info, group.reads[0].storage_index.fqn)
        expected = _expected(checksums, info, what)
        path = checkpoint_dir / info.relative_path
        with open_range(path, info) as f:
            nread = read_stored(f, group, resolve, what, expected, str(path), request)
        if progress is not None:
            progress(nread)
        return nread

    names = sorted(by_file)

    def load_file(name: str) -> int:
        ranges = [(g.info.offset, g.info.length) for g in by_file[name]]
        try:  # an object's items are fetched ahead, whole (records, data, trailer at once)
            with objstore.prefetching(checkpoint_dir / name, ranges):
                return sum(load_group(g) for g in by_file[name])
        finally:
            release_scratch()  # do not keep a chunk-sized buffer after the load

    if thread_count <= 1 or len(names) <= 1:
        return sum(load_file(name) for name in names)
    workers = min(thread_count, len(names))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dc-read") as pool:
        return sum(pool.map(load_file, names))


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
        path = checkpoint_dir / info.relative_path
        with open_range(path, info) as f:
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointCorruptedError(f"{path}: short read at offset {info.offset}")
        expected = _expected(checksums, info, _what(info, index.fqn))
        if expected is not None and not expected.matches_whole(data):
            raise mismatch(_what(info, index.fqn), info)
        out.append(data)
    return out
