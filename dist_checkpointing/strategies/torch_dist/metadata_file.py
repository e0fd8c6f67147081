"""DCP's `.metadata` and its load index: written atomically, read safely and checked.
`.metadata` is DCP's pickled `Metadata`, read with an allowlisting unpickler (stock DCP uses
`pickle.load`) and checked (dtypes, chunk bounds, storage paths), so damage reads as
corruption. The load index `.metadata.index` (JSON lines, docs/formats.md) holds the same
entries, so a loading rank decodes only the keys it asks for (`open_for_load`).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import pickle
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..._safe_load import enum_member_getter
from ...errors import CheckpointCorruptedError, CheckpointingException, UnsafeCheckpointError
from ...integrity import SUMS_SUFFIX, Checksums, checksum, read_checksums, write_checksums
from ...storage import objstore
from ...storage.fileio import read_capped
from ..common import COMMON_STATE_FNAME, write_bytes_atomically
from .plan import DATA_SUFFIX, overlapping

__all__ = [
    "DCP_METADATA_FNAME",
    "INDEX_FNAME",
    "serialize_metadata",
    "write_metadata_files",
    "read_metadata",
    "open_for_load",
    "plain_value_keys",
    "remove_sharded_tensors",
]

logger = logging.getLogger(__name__)

DCP_METADATA_FNAME = ".metadata"
INDEX_FNAME = ".metadata.index"
_MAX_METADATA_BYTES = 1 << 31


def _encode_index(md: Metadata) -> Optional[bytes]:
    """The load index of `md`; None where it cannot say everything a load needs of
    `.metadata` (`planner_data`, which only nests a stock DCP checkpoint's common state, is
    left out: our common state is in `common.pt`)."""
    if getattr(md, "mcore_data", None) is not None:
        return None
    files: Dict[str, int] = {}
    lines: List[bytes] = []
    keys = sorted(md.state_dict_metadata)
    for key in keys:
        entry: Any = md.state_dict_metadata[key]
        tensor = isinstance(entry, TensorStorageMetadata)
        rows = []
        for chunk in entry.chunks if tensor else [None]:
            info = md.storage_data.get(MetadataIndex(key, chunk.offsets if chunk else None))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            f = files.setdefault(str(info.relative_path), len(files))
            box = [*chunk.offsets, *chunk.sizes] if chunk else []
            rows.append([*box, f, info.offset, info.length])
        head: List[Any] = (
            [str(entry.properties.dtype)[6:], list(entry.size)] if tensor else [None, []]
        )
        lines.append(json.dumps([*head, rows], separators=(",", ":")).encode() + b"\n")
    ends = list(itertools.accumulate(map(len, lines)))
    top = {"format": 1, "files": list(files), "keys": keys, "ends": ends}
    return json.dumps(top, separators=(",", ":")).encode() + b"\n" + b"".join(lines)


def serialize_metadata(metadata: Metadata) -> Dict[str, bytes]:
    """`{file name: bytes}`: `.metadata` (DCP's pickle) and, where possible, its load index."""
    files = {DCP_METADATA_FNAME: pickle.dumps(metadata)}
    index = _encode_index(metadata)
    if index is not None:
        files[INDEX_FNAME] = index
    return files


def write_metadata_files(checkpoint_dir: Path, files: Dict[str, bytes]) -> Dict[str, int]:
    """Writes `serialize_metadata`'s files atomically (a stale index is removed); returns
    `{file name: xxh3-64}` of them."""
    for name, payload in files.items():
        write_bytes_atomically(payload, str(Path(checkpoint_dir) / name))
    if INDEX_FNAME not in files:
        objstore.remove(Path(checkpoint_dir) / INDEX_FNAME)
    return {name: checksum(payload) for name, payload in files.items()}


class _AnyReleaseTensorProperties(TensorProperties):
    """Unpickles `TensorProperties` as any torch release pickles them, into a plain
    `TensorProperties`: the 5-tuple state of torch <= 2.14, or the 6-tuple of newer releases
    (a `strides` field after the five). Strides are not kept: every chunk is read from its
    own stored layout."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 6:
            strides = state[5]
            if strides is not None and not (
                isinstance(strides, (tuple, list)) and all(isinstance(s, int) for s in strides)
            ):
                raise ValueError(f"TensorProperties: strides {strides!r} are not ints")
            state = state[:5]
        TensorProperties.__setstate__(self, state)
        self.__class__ = TensorProperties  # type: ignore[assignment]


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
    allowed[(md.__name__, "TensorProperties")] = _AnyReleaseTensorProperties
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    # megatron-core <= 0.13 also pickles each rank's plan (a SavePlan subclass adding a dict of
    # plain values); read as DCP's own SavePlan, whose state is set without running code
    allowed[("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")] = (
        planner.SavePlan
    )
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
    allowed[("builtins", "getattr")] = enum_member_getter(allowed.values())
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
    raw = read_capped(path, _MAX_METADATA_BYTES)
    if raw is None:
        raise CheckpointCorruptedError(f"{path}: DCP metadata file not found")
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
    try:
        _check_metadata(metadata, path)
    except (AttributeError, TypeError, ValueError) as e:  # objects of the right class, damaged
        raise CheckpointCorruptedError(
            f"{path}: malformed DCP metadata ({type(e).__name__}: {e})"
        ) from e
    return metadata


def _check_metadata(metadata: Any, path: Path) -> None:
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
            if not isinstance(value.properties.dtype, torch.dtype):
                raise CheckpointCorruptedError(f"{path}: entry {key!r} has no valid dtype")
            ndim = len(value.size)
            for chunk in value.chunks:
                if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim:
                    raise CheckpointCorruptedError(f"{path}: chunk of {key!r} has wrong rank")
                bounds = zip(chunk.offsets, chunk.sizes, value.size)
                if any(o < 0 or s < 0 or o + s > g for o, s, g in bounds):
                    raise CheckpointCorruptedError(
                        f"{path}: chunk of {key!r} lies outside {tuple(value.size)}"
                    )
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointCorruptedError(f"{path}: malformed storage entry {index!r}")
        rel = str(info.relative_path)
        bad_path = "/" in rel or "\\" in rel or rel in ("", ".", "..")
        if bad_path or info.offset < 0 or info.length < 0:
            raise CheckpointCorruptedError(
                f"{path}: invalid storage location {info!r} for {index.fqn!r}"
            )


def open_for_load(
    checkpoint_dir: Path,
    keys: Optional[Collection[str]],
    checksums: Optional[Checksums] = None,
    boxes: Optional[Mapping[str, Sequence[Tuple[Sequence[int], Sequence[int]]]]] = None,
) -> Metadata:
    """The metadata a load of `keys` needs: only those keys, from the load index; all of
    `.metadata` when `keys` is None or the index is missing (DCP, megatron-core, older
    checkpoints) or lacks a key. `checksums`: verify what is read. `boxes`: per tensor key,
    the `(offsets, sizes)` requested: only the stored chunks they overlap are kept (a rank
    reads a few of a layer-stacked key's hundreds of chunks).

    Raises:
        CheckpointCorruptedError: the file read is damaged or malformed (named).
        UnsafeCheckpointError: `.metadata` references a class outside DCP's metadata types.
    """
    path = Path(checkpoint_dir) / INDEX_FNAME
    raw = None if keys is None else read_capped(path, _MAX_METADATA_BYTES)
    if raw is None or keys is None:
        return read_metadata(checkpoint_dir, checksums)
    if checksums is not None:
        checksums.verify_file(INDEX_FNAME, raw, str(path))
    try:
        nl = raw.index(b"\n") + 1
        top = json.loads(raw[:nl])
        if top["format"] != 1:
            raise ValueError(f"format {top['format']!r}")
        files, ends = top["files"], top["ends"]
        for name in files:  # every file it names, not only those of the keys read now
            if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
                raise ValueError(f"file name {name!r} is not a file of this directory")
        position = dict(zip(top["keys"], range(len(ends))))
        if any(k not in position for k in keys):
            return read_metadata(checkpoint_dir, checksums)  # whose errors name what is missing
        sdm: Dict[str, Any] = {}
        storage: Dict[MetadataIndex, _StorageInfo] = {}
        for key in keys:
            i = position[key]
            dtype, shape, rows = json.loads(raw[nl + (ends[i - 1] if i else 0) : nl + ends[i]])
            n = len(shape)
            if any(len(row) != 2 * n + 3 for row in rows):
                raise ValueError(f"malformed entry of {key!r}")
            if dtype is not None and boxes is not None and key in boxes and rows:
                table = np.asarray(rows, dtype=np.int64)  # offsets, sizes, file, offset, length
                keep = np.zeros(len(rows), dtype=bool)
                for box in boxes[key]:
                    keep |= overlapping(table[:, :n], table[:, n : 2 * n], *box)
                rows = [rows[i] for i in np.nonzero(keep)[0]]
            for row in rows:
                info = _StorageInfo(files[row[-3]], row[-2], row[-1])
                storage[MetadataIndex(key, row[:n] if dtype else None)] = info
            if dtype is None:
                sdm[key] = BytesStorageMetadata()
            else:
                extents = [(torch.Size(r[:n]), torch.Size(r[n : 2 * n])) for r in rows]
                chunks = [ChunkStorageMetadata(offsets, sizes) for offsets, sizes in extents]
                props = TensorProperties(dtype=getattr(torch, dtype))
                sdm[key] = TensorStorageMetadata(props, torch.Size(shape), chunks)
        metadata = Metadata(state_dict_metadata=sdm, storage_data=storage, version="1.0.0")
        _check_metadata(metadata, path)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointCorruptedError(
            f"{path}: malformed load index ({type(e).__name__}: {e})"
        ) from e
    return metadata


def plain_value_keys(ckpt: Path, metadata: Metadata) -> Set[str]:
    """Keys of the common state's plain values that our saves also record as DCP items
    (`_dcp_plain`): those `planner_data` names where `common.pt` holds the common state.
    (Stock DCP records every key there and has no `common.pt`; megatron-core records none.)"""
    planner = metadata.planner_data
    if isinstance(planner, dict) and planner and objstore.is_file(Path(ckpt) / COMMON_STATE_FNAME):
        return set(planner)
    return set()


def remove_sharded_tensors(ckpt: Path, key_prefix: str) -> None:
    """Drops every key starting with `key_prefix` (a save's `separation_hint`) and the data
    files named with it, rewriting `.metadata`, its index and `checksums.json` first (not
    collective: one process, a checkpoint nobody writes).

    Raises:
        CheckpointingException: if no data file starts with the prefix, or kept keys live
            in those files (removing them would lose data).
    """
    ckpt = Path(ckpt)
    if not key_prefix:
        raise CheckpointingException("key_prefix must be non-empty")
    names = objstore.listdir(ckpt)
    doomed = sorted(n for n in names if n.endswith(DATA_SUFFIX) and n.startswith(key_prefix))
    if not doomed:
        raise CheckpointingException(
            f"No data file in {ckpt} starts with {key_prefix!r}; was it saved with separation_hint?"
        )
    metadata = read_metadata(ckpt)
    doomed_set = set(doomed)
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(key_prefix) and str(info.relative_path) in doomed_set:
            raise CheckpointingException(
                f"Key {index.fqn!r} is stored in {info.relative_path}, which would be removed"
            )

    def kept(entries: Dict[Any, Any], key: Callable[[Any], str] = str) -> Dict[Any, Any]:
        return {k: v for k, v in entries.items() if not key(k).startswith(key_prefix)}

    metadata.state_dict_metadata = kept(metadata.state_dict_metadata)
    metadata.storage_data = kept(metadata.storage_data, lambda index: index.fqn)
    if isinstance(metadata.planner_data, dict):
        metadata.planner_data = kept(metadata.planner_data)
    sums = read_checksums(ckpt)
    digests = write_metadata_files(ckpt, serialize_metadata(metadata))
    if sums is not None:
        sums.files.pop(INDEX_FNAME, None)
        sums.files.update(digests)
        for name in doomed:
            sums.ranges.pop(name, None)
            sums.files.pop(name + SUMS_SUFFIX, None)  # (the sealed record binds sidecars)
        write_checksums(ckpt, sums)
    for name in doomed:
        objstore.remove(ckpt / name)
        objstore.remove(ckpt / (name + SUMS_SUFFIX))
    logger.info("Removed keys with prefix %r and %d file(s) from %s", key_prefix, len(doomed), ckpt)
