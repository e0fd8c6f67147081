"""DCP's `.metadata` file: written atomically, read with an allowlisting unpickler and checked.

`.metadata` is a pickled DCP `Metadata`. Reading it never runs arbitrary code (an allowlist
of DCP's metadata classes, where stock DCP uses `pickle.load`), and its entries are checked
(dtypes, chunk bounds, storage paths) so a damaged file is reported as corruption.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointCorruptedError, UnsafeCheckpointError
from ...integrity import Checksums, checksum
from ...storage.fileio import atomic_write, read_capped

__all__ = ["DCP_METADATA_FNAME", "write_metadata", "replace_metadata", "read_metadata"]

DCP_METADATA_FNAME = ".metadata"
_MAX_METADATA_BYTES = 1 << 31


def write_metadata(checkpoint_dir: Path, metadata: Metadata, results: Sequence[WriteResult]) -> int:
    """Attaches storage locations to `metadata` and writes `.metadata` atomically.

    Returns:
        The xxh3-64 of the written file.
    """
    metadata.storage_data = {r.index: r.storage_data for r in results}
    metadata.version = metadata.version or "1.0.0"
    return replace_metadata(checkpoint_dir, metadata)


def replace_metadata(checkpoint_dir: Path, metadata: Metadata) -> int:
    """Writes `metadata` as the checkpoint's `.metadata`, atomically (readers see old or new).

    Returns:
        The xxh3-64 of the written file.
    """
    payload = pickle.dumps(metadata)
    atomic_write(Path(checkpoint_dir) / DCP_METADATA_FNAME, lambda f: f.write(payload))
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
            if not isinstance(value.properties.dtype, torch.dtype):
                raise CheckpointCorruptedError(f"{path}: entry {key!r} has no valid dtype")
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
