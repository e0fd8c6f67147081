"""`convert_checkpoint`: the full tensors of a `torch_dist` (ours, megatron-core) or stock
DCP checkpoint as safetensors shards or one `torch.save` file. Not collective.

Files are laid out from the metadata alone and written one tensor at a time, so memory stays
at the largest tensor (plus one stored chunk of it and I/O buffers).
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import re
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..core import maybe_load_config
from ..errors import CheckpointExistsError, CheckpointingException, NotACheckpointError
from ..strategies.torch_dist.zipformat import STORAGE_CLASS
from . import _storage
from ._info import PathArg, check_dir, is_stock_dcp, unreadable_backend
from ._local_info import local_tier

__all__ = ["ConvertResult", "convert_checkpoint", "parse_size", "SAFETENSORS_INDEX"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_Entry = Tuple[str, torch.dtype, Tuple[int, ...]]  # key, dtype, shape
_ST_CODES = (
    "float64 F64 float32 F32 float16 F16 bfloat16 BF16 int64 I64 int32 I32 int16 I16 int8 I8 "
    "uint8 U8 bool BOOL float8_e4m3fn F8_E4M3 float8_e5m2 F8_E5M2 uint16 U16 uint32 U32 uint64 U64"
).split()
#: dtype -> safetensors' name for it (the unsigned types that this torch has)
SAFETENSORS_DTYPES: Dict[torch.dtype, str] = {
    getattr(torch, name): code
    for name, code in zip(_ST_CODES[::2], _ST_CODES[1::2])
    if isinstance(getattr(torch, name, None), torch.dtype)
}


@dataclass
class ConvertResult:
    """What `convert_checkpoint` wrote: files (in order), tensor count and data bytes."""

    files: List[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def safetensors_header(entries: List[_Entry]) -> bytes:
    """The length prefix and header of a safetensors file of `entries`; raises on a bad dtype."""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape in entries:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise CheckpointingException(f"{key!r}: safetensors cannot store dtype {dtype}")
        end = offset + _nbytes((key, dtype, shape))
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


_StorageRef = collections.namedtuple("_StorageRef", "cls key numel")


class _Rebuild(collections.namedtuple("_Rebuild", "ref shape dtype", defaults=(None,))):
    """Pickles as `torch.save` does a contiguous tensor over storage `ref` (`dtype`: set for an
    untyped storage, as torch writes dtypes without a typed storage class)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        stride = torch.empty(self.shape, device="meta").stride()  # contiguous, no allocation
        hooks: collections.OrderedDict[str, Any] = collections.OrderedDict()  # a plain one: pickled
        args = (self.ref, 0, self.shape, stride, False, hooks)
        if self.dtype is None:
            return (torch._utils._rebuild_tensor_v2, args)
        return (torch._utils._rebuild_tensor_v3, (*args, self.dtype))  # bytes and a dtype


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, _StorageRef):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def parse_size(text: Union[str, int]) -> int:
    """`"5GB"`, `"500MiB"`, `"1000"` -> bytes (decimal and binary units, case-insensitive).

    Raises:
        CheckpointingException: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise CheckpointingException(f"invalid size {text!r} (e.g. 5GB, 500MiB, 1000000)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointingException(f"size must be positive, got {text!r}")
    return value


def _source(ckpt: Path, verb: str = "convert") -> Tuple[Any, Any]:
    """Metadata and checksums of a checkpoint `verb` (the tool's name) reads: torch_dist or
    stock DCP; anything else is named with what reads it."""
    check_dir(ckpt)
    config = maybe_load_config(ckpt)
    if config is not None and config.sharded_backend != "torch_dist":
        raise CheckpointingException(
            f"{ckpt}: {unreadable_backend(config.sharded_backend, config.sharded_backend_version, verb)}"
        )
    if config is None and local_tier(ckpt):
        raise NotACheckpointError(
            f"{ckpt}: a checkpoint manager's local tier (LocalCheckpointManager parts); {verb} "
            "reads torch_dist and stock DCP checkpoints: `dist-ckpt inspect` and `verify` read "
            "local tiers, LocalCheckpointManager.load restores them"
        )
    if config is None and not is_stock_dcp(ckpt):
        raise NotACheckpointError(
            f"{ckpt}: {verb} found no metadata.json (the commit record) nor a stock DCP "
            "checkpoint: a save that did not finish, or not a checkpoint"
        )
    checksums = _storage.maybe_checksums(ckpt)
    return _storage.read_dcp_metadata(ckpt, checksums), checksums


def _shards(entries: List[_Entry], limit: int) -> List[List[_Entry]]:
    """Packs entries in order into shards of at most `limit` bytes (a bigger tensor alone)."""
    shards: List[List[_Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = _nbytes(e)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards if shards[0] else []


def _nbytes(entry: _Entry) -> int:
    return math.prod(entry[2]) * entry[1].itemsize


def convert_checkpoint(
    src: PathArg,
    out: PathArg,
    to: str = "safetensors",
    *,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    progress: Optional[bool] = None,
) -> ConvertResult:
    """Writes the full tensors of a `torch_dist` or stock DCP checkpoint to another format.

    Args:
        src: the checkpoint directory.
        out: 'safetensors': a directory for `model-0000i-of-0000N.safetensors` files and
            their index; 'torch': the file to write (`torch.load(out)`: `{key: tensor}`).
        to: 'safetensors' or 'torch'.
        max_shard_size: bytes (or e.g. "5GB") per safetensors file (a larger tensor alone).
        progress: show a tqdm bar (default: when stderr is a terminal).

    Raises:
        NotACheckpointError: `src` is missing or not a complete checkpoint.
        CheckpointExistsError: the output already exists.
        CheckpointCorruptedError: a damaged chunk (checked against `checksums.json`).
        CheckpointingException: another backend, an unknown format or an unstorable dtype.
    """
    ckpt, dest = Path(src), Path(out)
    if to not in ("safetensors", "torch"):
        raise CheckpointingException(f"unknown output format {to!r} (safetensors or torch)")
    limit = parse_size(max_shard_size)
    metadata, checksums = _source(ckpt)
    entries = [
        (key, md.properties.dtype, tuple(int(s) for s in md.size))
        for key, md in sorted(_storage.tensor_entries(metadata, ckpt).items())
    ]
    result = ConvertResult(tensors=len(entries), bytes=sum(_nbytes(e) for e in entries))
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=result.bytes, unit="B", unit_scale=True, desc="convert", disable=not show)

    def read(key: str) -> torch.Tensor:  # one whole tensor at a time
        tensor = _storage.read_full_tensor(ckpt, metadata, key, checksums)
        bar.update(tensor.nbytes)
        return tensor

    with bar:
        if to == "torch":
            _write_torch(entries, dest, read)
            result.files.append(str(dest))
        else:
            result.files = _write_safetensors(entries, dest, limit, read)
    return result


_Read = Callable[[str], torch.Tensor]


def _write_torch(entries: List[_Entry], dest: Path, read: _Read) -> None:
    if dest.exists():
        raise CheckpointExistsError(f"{dest} already exists; choose another output path")
    refs = {}
    for i, (key, dtype, shape) in enumerate(entries):
        name, n = STORAGE_CLASS.get(dtype), math.prod(shape)
        if name is None:  # no typed storage class (float8, ...): torch.save stores raw bytes
            untyped = _StorageRef(torch.UntypedStorage, str(i), n * dtype.itemsize)
            refs[key] = _Rebuild(untyped, shape, dtype)
        else:
            refs[key] = _Rebuild(_StorageRef(getattr(torch, name), str(i), n), shape)
    payload = io.BytesIO()
    _Pickler(payload, protocol=2).dump(refs)
    tmp = dest.with_name(dest.name + ".partial")
    try:  # a stored zip as `torch.save` writes it, one tensor in memory at a time
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", payload.getvalue())
            z.writestr("archive/byteorder", "little")
            for i, (key, _, _) in enumerate(entries):
                with z.open(f"archive/data/{i}", "w", force_zip64=True) as out:
                    out.write(tensor_bytes(read(key)))
            z.writestr("archive/version", "3\n")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _write_safetensors(entries: List[_Entry], dest: Path, limit: int, read: _Read) -> List[str]:
    if (dest / SAFETENSORS_INDEX).exists() or any(dest.glob("model-*.safetensors")):
        raise CheckpointExistsError(
            f"{dest} already holds safetensors files; choose another directory"
        )
    dest.mkdir(parents=True, exist_ok=True)
    shards = _shards(entries, limit)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: Dict[str, str] = {}
    written = []
    try:
        for name, shard in zip(names, shards):
            path = dest / name
            written.append(path)
            with open(path, "wb") as f:
                f.write(safetensors_header(shard))
                for key, _, _ in shard:
                    f.write(tensor_bytes(read(key)))
                    weight_map[key] = name
        total = sum(_nbytes(e) for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dest / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except BaseException:
        for path in written:  # no half-written set of files looks complete
            path.unlink(missing_ok=True)
        raise
    return [str(dest / n) for n in names] + [str(dest / SAFETENSORS_INDEX)]
