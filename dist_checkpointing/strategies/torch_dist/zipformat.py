"""The torch.save-compatible zip layout of one tensor item (uncompressed), only here:
`zip_item_layout` builds the records around a tensor's raw bytes ahead of time, the data
at a chosen file alignment. `chunk_layout` and `head_layout` locate a C-contiguous chunk's
bytes by reading `data.pkl` with an unpickler that knows only the tensor-rebuild recipe
(nothing is executed); anything unexpected gives None, and the reader uses `torch.load`.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

__all__ = [
    "STORAGE_CLASS",
    "ZipItemLayout",
    "zip_item_layout",
    "ChunkLayout",
    "chunk_layout",
    "head_layout",
]

_PREFIX = "archive/"
_FLAGS = 0x0808  # data descriptor follows, UTF-8 names
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<4sIII")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_EOCD = struct.Struct("<4sHHHHIIH")
_RECORD_ALIGN = 64
_MAX_RECORD = (1 << 32) - (1 << 20)

#: dtype -> the storage class name `torch.save` records for it (also the tools' table)
STORAGE_CLASS = {
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}


class _StorageRef:
    def __init__(self, cls: type, numel: int) -> None:
        self.cls, self.numel = cls, numel


class _Rebuild:
    def __init__(self, ref: _StorageRef, shape: Tuple[int, ...], stride: Tuple[int, ...]) -> None:
        self.ref, self.shape, self.stride = ref, shape, stride

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (
            torch._utils._rebuild_tensor_v2,
            (self.ref, 0, self.shape, self.stride, False, collections.OrderedDict()),
        )


class _TensorPickler(pickle.Pickler):
    def persistent_id(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, _StorageRef):
            return ("storage", obj.cls, "0", "cpu", obj.numel)
        return None


def _strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _data_pkl(dtype: torch.dtype, shape: Tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    numel = math.prod(shape)
    ref = _StorageRef(getattr(torch, STORAGE_CLASS[dtype]), numel)
    _TensorPickler(buf, protocol=2).dump(_Rebuild(ref, shape, _strides(shape)))
    return buf.getvalue()


@dataclass(frozen=True)
class ZipItemLayout:
    """One tensor item: `head` bytes, then the tensor's raw bytes, then `tail` bytes."""

    head: bytes
    data_nbytes: int
    tail: bytes

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.data_nbytes + len(self.tail)


class _Builder:
    def __init__(self, base: int) -> None:
        self.base = base  # file offset of the item's first byte
        self.parts: List[bytes] = []
        self.pos = 0
        self.entries: List[Tuple[str, int, int]] = []  # name, local header offset, size

    def _local(self, name: str, size: int, align: int) -> None:
        raw = (_PREFIX + name).encode()
        start = self.pos + _LOCAL.size + len(raw) + 4  # 4: extra field header
        pad = (-(self.base + start)) % align
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        header = _LOCAL.pack(b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw), len(extra))
        self.entries.append((_PREFIX + name, self.pos, size))
        self._emit(header + raw + extra)

    def _emit(self, data: bytes) -> None:
        self.parts.append(data)
        self.pos += len(data)

    def _descriptor(self, size: int) -> None:
        self._emit(_DESCRIPTOR.pack(b"PK\x07\x08", 0, size, size))

    def record(self, name: str, data: bytes) -> None:
        self._local(name, len(data), _RECORD_ALIGN)
        self._emit(data)
        self._descriptor(len(data))

    def directory(self) -> None:
        start = self.pos
        for name, offset, size in self.entries:
            raw = name.encode()
            fields = (0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(raw), 0, 0, 0, 0, 0, offset)
            self._emit(_CENTRAL.pack(b"PK\x01\x02", *fields) + raw)
        size, n = self.pos - start, len(self.entries)
        z64 = self.pos
        self._emit(_ZIP64_EOCD.pack(b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, n, n, size, start))
        self._emit(_ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, z64, 1))
        self._emit(_EOCD.pack(b"PK\x05\x06", 0, 0, n, n, size, start, 0))


def zip_item_layout(
    dtype: torch.dtype, shape: Tuple[int, ...], file_offset: int, data_align: int = 4096
) -> Optional[ZipItemLayout]:
    """The bytes around a tensor's (C-contiguous) data for an item starting at `file_offset`,
    the data at a multiple of `data_align`; None for a dtype without a storage class or a
    >4 GiB tensor."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if dtype not in STORAGE_CLASS or nbytes > _MAX_RECORD:
        return None
    b = _Builder(file_offset)
    b.record("data.pkl", _data_pkl(dtype, shape))
    b.record(".format_version", b"1")
    b.record(".storage_alignment", b"64")
    b.record("byteorder", b"little")
    b._local("data/0", nbytes, max(data_align, _RECORD_ALIGN))
    head = b"".join(b.parts)
    b.parts = []
    b.pos += nbytes
    b._descriptor(nbytes)
    b.record("version", b"3\n")
    b.record(".data/serialization_id", b"0" * 40)
    b.directory()
    return ZipItemLayout(head, nbytes, b"".join(b.parts))


#: storage class name -> dtype (the inverse of `STORAGE_CLASS`); an untyped storage (what
#: `torch.save` records for float8 and other dtypes without a class) counts bytes
_STORAGE_DTYPES = {name: dtype for dtype, name in STORAGE_CLASS.items()}
_STORAGE_DTYPES["UntypedStorage"] = torch.uint8
#: what a damaged or unexpected item raises while it is parsed (then: not the plain layout)
_PARSE_ERRORS = (
    pickle.UnpicklingError,
    KeyError,
    ValueError,
    TypeError,
    AttributeError,
    struct.error,
    EOFError,
)


@dataclass(frozen=True)
class ChunkLayout:
    """Where a stored chunk's C-contiguous bytes are, relative to the item's start."""

    data_offset: int
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _Recipe:
    storage: _Storage
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


def _recipe(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> _Recipe:
    dtype = rest[2] if len(rest) > 2 else None  # `_rebuild_tensor_v3`: bytes and a dtype
    if isinstance(dtype, torch.dtype) and storage.dtype == torch.uint8:
        storage = _Storage(storage.key, dtype, storage.numel // dtype.itemsize)
    return _Recipe(storage, int(offset), tuple(size), tuple(stride))


class _RecipeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _recipe
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return torch.UntypedStorage
        storage = getattr(torch, name, None) if module == "torch" else None
        if isinstance(storage, torch.dtype) or (
            name.endswith("Storage") and isinstance(storage, type)
        ):
            return storage
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        tag, storage_type, key, _location, numel = pid
        if tag != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {tag!r}")
        name = storage_type.__name__ if isinstance(storage_type, type) else str(storage_type)
        return _Storage(str(key), _STORAGE_DTYPES[name], int(numel))


def _record_start(item: io.RawIOBase, info: zipfile.ZipInfo) -> Optional[int]:
    """Offset of a stored record's data (read from its local header), or None."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    item.seek(info.header_offset)
    header = _LOCAL.unpack(item.read(_LOCAL.size))
    if header[0] != b"PK\x03\x04":
        return None
    return info.header_offset + _LOCAL.size + header[9] + header[10]


def _layout_from(recipe: _Recipe, data_start: int, storage_nbytes: int) -> Optional[ChunkLayout]:
    """The layout of a C-contiguous chunk whose storage record holds `storage_nbytes` bytes
    from `data_start`, or None when the recipe describes anything else."""
    if recipe.stride != _strides(recipe.shape) and math.prod(recipe.shape) > 1:
        return None
    itemsize = recipe.storage.dtype.itemsize
    layout = ChunkLayout(data_start + recipe.offset * itemsize, recipe.storage.dtype, recipe.shape)
    if recipe.offset * itemsize + layout.nbytes > storage_nbytes:
        return None
    return layout


def head_layout(head: bytes, data_off: int, data_len: int) -> Optional[ChunkLayout]:
    """Locates a chunk's data from `head`, the item's bytes before its data, alone, or None,
    for items whose first record is `data.pkl` and whose storage record is known (from the
    checksums, whose frame digest is checked later) to span `[data_off, data_off + data_len)`:
    unlike `chunk_layout` (the directory at the item's end), no extra random read per chunk.
    """
    try:
        if len(head) != data_off or len(head) < _LOCAL.size:
            return None
        header = _LOCAL.unpack_from(head, 0)
        if header[0] != b"PK\x03\x04" or header[3] != zipfile.ZIP_STORED:
            return None
        name_end = _LOCAL.size + header[9]
        if not head[_LOCAL.size : name_end].decode("utf-8").endswith("/data.pkl"):
            return None
        pkl = io.BytesIO(head[name_end + header[10] :])
        recipe = _RecipeUnpickler(pkl).load()
        s = recipe.storage if isinstance(recipe, _Recipe) else None
        if s is None or s.numel * s.dtype.itemsize != data_len:
            return None
        return _layout_from(recipe, data_off, data_len)
    except (*_PARSE_ERRORS, IndexError):  # a UnicodeDecodeError is a ValueError
        return None


def chunk_layout(item: io.RawIOBase) -> Optional[ChunkLayout]:
    """Locates the data of a `torch.save`d tensor item (a seekable view of it alone), or None."""
    try:
        # the directory only: zipfile would check CRCs, which our writer leaves out
        zf = zipfile.ZipFile(item)  # type: ignore[arg-type]
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        pkl_info = zf.getinfo(pkl)
        pkl_start = _record_start(item, pkl_info)
        if pkl_start is None:
            return None
        item.seek(pkl_start)
        recipe = _RecipeUnpickler(io.BytesIO(item.read(pkl_info.file_size))).load()
        if not isinstance(recipe, _Recipe):
            return None
        info = zf.getinfo(f"{pkl[: -len('data.pkl')]}data/{recipe.storage.key}")
        start = _record_start(item, info)
        if start is None:
            return None
        return _layout_from(recipe, start, info.file_size)
    except (*_PARSE_ERRORS, zipfile.BadZipFile, StopIteration):
        return None
