"""File I/O of the torch_dist backend, in PyTorch DCP's on-disk format.

Layout: `.metadata` (a pickled `torch.distributed.checkpoint.metadata.Metadata` whose
`storage_data` maps each item to a byte range of a data file) and data files
`[<hint>]__<rank>_<n>.distcp` holding, back to back, a `torch.save` payload per tensor
chunk and raw bytes per object.

Reading `.metadata` never runs arbitrary code: it is unpickled with an allowlist of DCP's
metadata classes (stock DCP uses plain `pickle.load`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._fileio import atomic_write, fsync_dir
from .._safe_load import torch_load
from ..errors import CheckpointCorruptedError, UnsafeCheckpointError
from ..integrity import Checksums, checksum, new_hasher
from ._dcp_fastread import chunk_layout, read_into
from ._dcp_plan import WriteEntry

__all__ = [
    "DCP_METADATA_FNAME",
    "DATA_SUFFIX",
    "data_file_name",
    "write_files",
    "write_staged_files",
    "write_metadata",
    "read_metadata",
    "read_tensor_items",
    "read_byte_items",
]

logger = logging.getLogger(__name__)

DCP_METADATA_FNAME = ".metadata"
DATA_SUFFIX = ".distcp"
_MAX_METADATA_BYTES = 1 << 31


def data_file_name(group: str, rank: int, index: int) -> str:
    """Name of a rank's n-th data file; `group` is '' or the separation hint."""
    return f"{group}__{rank}_{index}{DATA_SUFFIX}"


def _owning_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage is exactly its data (torch.save writes whole storages)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class _HashingWriter:
    """A write-only file wrapper that also feeds every byte to a hasher (when one is set)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.hasher: Any = None

    def write(self, data: Any) -> int:
        if self.hasher is not None:
            self.hasher.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()


#: `(file name, offset, length, xxh3-64)` of one written item
ItemChecksum = Tuple[str, int, int, int]


def _write_one_file(
    path: Path, entries: Sequence[WriteEntry], checksums: bool
) -> Tuple[List[WriteResult], List[ItemChecksum]]:
    results, sums = [], []
    with _no_zip_crc(), open(path, "wb") as raw:
        f = _HashingWriter(raw)
        for e in entries:
            offset = raw.tell()
            f.hasher = new_hasher() if checksums else None
            if e.item.type == WriteItemType.BYTE_IO:
                f.write(e.data)
            else:
                assert isinstance(e.data, torch.Tensor)
                torch.save(_owning_tensor(e.data), f)  # type: ignore[arg-type]
            length = raw.tell() - offset
            results.append(
                WriteResult(
                    index=e.item.index,
                    size_in_bytes=length,
                    storage_data=_StorageInfo(path.name, offset, length),
                )
            )
            if f.hasher is not None:
                sums.append((path.name, offset, length, f.hasher.intdigest()))
        raw.flush()
        os.fsync(raw.fileno())
    return results, sums


@contextlib.contextmanager
def _no_zip_crc() -> Iterator[None]:
    """Skips the zip CRC32 that `torch.save` computes (up to 40% of its CPU time).

    Readers (`torch.load`, hence DCP and megatron-core) do not check it. The option is
    per thread in PyTorch, so each writer thread sets it and restores it afterwards.
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def write_files(
    checkpoint_dir: Path,
    files: Sequence[Tuple[str, Sequence[WriteEntry]]],
    thread_count: int,
    checksums: bool = True,
) -> Tuple[List[WriteResult], List[ItemChecksum]]:
    """Writes data files (one thread per file, up to `thread_count`), each fsync'd.

    Args:
        checkpoint_dir: destination directory (exists).
        files: `(file name, entries)` pairs.
        thread_count: maximum number of files written at once.
        checksums: compute each item's xxh3-64 while writing it.

    Returns:
        The write results (item index -> file, offset, length) of every entry, and the
        items' checksums (empty without `checksums`).
    """
    if not files:
        return [], []
    jobs = [(checkpoint_dir / name, entries, checksums) for name, entries in files]
    workers = max(1, min(thread_count, len(jobs)))
    if workers == 1:
        nested = [_write_one_file(*job) for job in jobs]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dc-write") as pool:
            nested = list(pool.map(lambda job: _write_one_file(*job), jobs))
    fsync_dir(checkpoint_dir)
    return [r for rs, _ in nested for r in rs], [c for _, cs in nested for c in cs]


def write_staged_files(
    checkpoint_dir: Path,
    flat: torch.Tensor,
    plan: Sequence[Tuple[str, Sequence[Tuple[Any, Any]]]],
    thread_count: int,
    checksums: bool = True,
) -> Tuple[List[WriteResult], List[ItemChecksum]]:
    """Writes files whose tensors were staged in one flat host buffer (async save).

    Args:
        checkpoint_dir: destination directory.
        flat: the staging buffer.
        plan: `(file name, [(WriteItem, TensorSlot or serialized bytes)])` pairs.
        thread_count: maximum number of files written at once.

    Returns:
        The write results, as `write_files`.
    """
    from ._staging import TensorSlot, slot_view

    files = [
        (
            name,
            [
                WriteEntry(item, slot_view(flat, src) if isinstance(src, TensorSlot) else src)
                for item, src in entries
            ],
        )
        for name, entries in plan
    ]
    return write_files(Path(checkpoint_dir), files, thread_count, checksums)


def write_metadata(checkpoint_dir: Path, metadata: Metadata, results: Sequence[WriteResult]) -> int:
    """Attaches storage locations to `metadata` and writes `.metadata` atomically.

    Returns:
        The xxh3-64 of the written file.
    """
    metadata.storage_data = {r.index: r.storage_data for r in results}
    metadata.version = metadata.version or "1.0.0"
    payload = pickle.dumps(metadata)
    atomic_write(checkpoint_dir / DCP_METADATA_FNAME, lambda f: f.write(payload))
    return checksum(payload)


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    import pathlib

    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as planner

    safe_names = {
        md: (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        ),
        # megatron-core pickles its global save plan (plain dataclasses and enums) beside it
        planner: (
            "SavePlan",
            "WriteItem",
            "TensorWriteData",
            "BytesIOWriteData",
            "WriteItemType",
            "LoadPlan",
            "ReadItem",
            "LoadItemType",
        ),
    }
    allowed: Dict[Tuple[str, str], Any] = {
        (module.__name__, name): getattr(module, name)
        for module, names in safe_names.items()
        for name in names
        if hasattr(module, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed: Dict[Tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"refusing to unpickle {module}.{name}: not a DCP metadata type"
            ) from None


def read_metadata(checkpoint_dir: Path, checksums: Optional[Checksums] = None) -> Metadata:
    """Reads `.metadata` with an allowlisting unpickler, verified when `checksums` list it.

    Raises:
        CheckpointCorruptedError: if it is missing, truncated, fails verification or is not
            DCP metadata.
        UnsafeCheckpointError: if it references any class outside DCP's metadata types.
    """
    path = Path(checkpoint_dir) / DCP_METADATA_FNAME
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _allowed_globals()
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_METADATA_BYTES + 1)
    except FileNotFoundError as e:
        raise CheckpointCorruptedError(f"{path}: DCP metadata file not found") from e
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot be read ({e})") from e
    if len(raw) > _MAX_METADATA_BYTES:
        raise CheckpointCorruptedError(f"{path}: larger than {_MAX_METADATA_BYTES} bytes")
    if checksums is not None:
        checksums.verify_file(DCP_METADATA_FNAME, raw, str(path))
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{path}: {e}") from e
    except Exception as e:  # any unpickling failure means a damaged file
        raise CheckpointCorruptedError(
            f"{path}: cannot read DCP metadata ({type(e).__name__}: {e})"
        ) from e
    _check_metadata(metadata, path)
    return metadata


def _check_metadata(metadata: Any, path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptedError(
            f"{path}: expected DCP Metadata, got {type(metadata).__name__}"
        )
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptedError(f"{path}: state_dict_metadata/storage_data are not dicts")
    for key, value in sdm.items():
        if not isinstance(key, str) or not isinstance(
            value, (TensorStorageMetadata, BytesStorageMetadata)
        ):
            raise CheckpointCorruptedError(f"{path}: malformed entry for key {key!r}")
        if isinstance(value, TensorStorageMetadata):
            ndim = len(value.size)
            for chunk in value.chunks:
                if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim:
                    raise CheckpointCorruptedError(f"{path}: chunk of {key!r} has wrong rank")
                if any(
                    o < 0 or s < 0 or o + s > g
                    for o, s, g in zip(chunk.offsets, chunk.sizes, value.size)
                ):
                    raise CheckpointCorruptedError(
                        f"{path}: chunk of {key!r} lies outside {tuple(value.size)}"
                    )
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointCorruptedError(f"{path}: malformed storage entry {index!r}")
        rel = str(info.relative_path)
        if (
            "/" in rel
            or "\\" in rel
            or rel in ("", ".", "..")
            or info.offset < 0
            or info.length < 0
        ):
            raise CheckpointCorruptedError(
                f"{path}: invalid storage location {info!r} for {index.fqn!r}"
            )


def _storage_info(metadata: Metadata, index: MetadataIndex) -> _StorageInfo:
    try:
        return metadata.storage_data[index]
    except KeyError as e:
        raise CheckpointCorruptedError(
            f"No storage location for {index.fqn!r} at {index.offset}"
        ) from e


def _read_range(checkpoint_dir: Path, info: _StorageInfo) -> bytes:
    path = checkpoint_dir / info.relative_path
    with _open_range(path, info) as f:
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
def _open_range(path: Path, info: _StorageInfo) -> Iterator[io.BufferedReader]:
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
class _ChunkGroup:
    info: _StorageInfo
    reads: List[ReadItem]


def read_tensor_items(
    checkpoint_dir: Path,
    metadata: Metadata,
    reads: Sequence[ReadItem],
    resolve: Callable[[ReadItem], torch.Tensor],
    thread_count: int = 2,
    checksums: Optional[Checksums] = None,
) -> int:
    """Reads each needed stored chunk once and copies the requested regions out of it.

    Args:
        checkpoint_dir: the checkpoint directory.
        metadata: its DCP metadata.
        reads: planned reads (see `plan_tensor_reads`).
        resolve: returns the destination view for a read item.
        thread_count: chunks loaded in parallel.
        checksums: when given, every item read is verified against it.

    Returns:
        Bytes read from storage.

    Raises:
        CheckpointCorruptedError: on a missing, truncated, malformed or (with `checksums`)
            damaged chunk, naming the file, key and byte range.
    """
    groups: Dict[Tuple[str, int], _ChunkGroup] = {}
    for r in reads:
        info = _storage_info(metadata, r.storage_index)
        groups.setdefault(
            (str(info.relative_path), info.offset), _ChunkGroup(info, [])
        ).reads.append(r)

    def load_group(group: _ChunkGroup) -> int:
        what = (
            f"{group.info.relative_path}@{group.info.offset} ({group.reads[0].storage_index.fqn!r})"
        )
        info = group.info
        expected = (
            checksums.expected_range(str(info.relative_path), info.offset, info.length, what)
            if checksums is not None
            else None
        )
        with _open_range(checkpoint_dir / info.relative_path, info) as stream:
            stored = _read_stored(stream, group, resolve, what, expected)
        if stored is None:  # read straight into the destination
            return group.info.length
        for r in group.reads:
            try:
                src = stored
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
        return group.info.length

    ordered = sorted(groups.values(), key=lambda g: (str(g.info.relative_path), g.info.offset))
    if thread_count <= 1 or len(ordered) <= 1:
        return sum(load_group(g) for g in ordered)
    with ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="dc-read") as pool:
        return sum(pool.map(load_group, ordered))


def _mismatch(what: str, info: _StorageInfo) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(
        f"{what}: checksum mismatch in bytes {info.offset}-{info.offset + info.length} of "
        f"{info.relative_path}: the stored data is damaged"
    )


def _verify_around(raw: Any, layout: Any, data: torch.Tensor, length: int, expected: int) -> bool:
    """Whether the item's bytes (its zip records around the data, and the data) hash to `expected`."""
    h = new_hasher()
    raw.seek(0)
    h.update(raw.read(layout.data_offset))
    if layout.nbytes:
        h.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    raw.seek(layout.data_offset + layout.nbytes)
    h.update(raw.read(length - layout.data_offset - layout.nbytes))
    return h.intdigest() == expected


def _read_stored(
    stream: io.BufferedReader,
    group: _ChunkGroup,
    resolve: Callable[[ReadItem], torch.Tensor],
    what: str,
    expected: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Returns the stored chunk as a tensor, or None when it was read into its destination.

    The zip is parsed directly when it is a plain contiguous chunk (no `torch.load`, one
    copy from the page cache); otherwise `torch.load` decodes it. With `expected`, the
    item's bytes are verified (a mismatch raises after reading, before anything is used).
    """
    raw = stream.raw
    layout = chunk_layout(raw)  # type: ignore[arg-type]
    if layout is None:
        stream.seek(0)
        payload = stream.read()
        if expected is not None and checksum(payload) != expected:
            raise _mismatch(what, group.info)
        stored = torch_load(io.BytesIO(payload), what)
        if not isinstance(stored, torch.Tensor):
            raise CheckpointCorruptedError(
                f"{what}: expected a tensor, got {type(stored).__name__}"
            )
        return stored
    try:
        target: Optional[torch.Tensor] = None
        if len(group.reads) == 1:
            r = group.reads[0]
            whole = all(o == 0 for o in r.storage_offsets) and tuple(r.lengths) == layout.shape
            dest = resolve(r)
            if whole and read_into(raw, layout, dest):  # type: ignore[arg-type]
                target = dest
        stored = None
        if target is None:
            stored = torch.empty(layout.shape, dtype=layout.dtype)
            read_into(raw, layout, stored)  # type: ignore[arg-type]
            target = stored
        if expected is not None and not _verify_around(
            raw, layout, target, group.info.length, expected
        ):
            raise _mismatch(what, group.info)
    except EOFError as e:
        raise CheckpointCorruptedError(f"{what}: {e}") from e
    return stored


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
            if expected is not None and checksum(data) != expected:
                raise _mismatch(what, info)
        out.append(data)
    return out
