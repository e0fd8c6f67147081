"""`torch.save`-compatible zip bytes for one tensor, generated without pickling the data.

A DCP tensor item is a `torch.save` archive. We build its small records (the tensor-rebuild
pickle, version records, zip directory) ourselves, so the tensor bytes can be written raw
from aligned staging buffers, with the data record placed at a chosen file alignment (4096
for O_DIRECT). The records mirror what `torch.save` writes (stored, CRC-less records with
data descriptors, zip64 end records), so `torch.load`, DCP and megatron-core read them.

Items are limited to 4 GiB per record (no zip64 record sizes); larger tensors, and dtypes
without a storage class, are left to `torch.save`.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

__all__ = ["ZipItemLayout", "zip_item_layout", "supports"]

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

_STORAGE_CLASS = {
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


def supports(dtype: torch.dtype, nbytes: int) -> bool:
    """Whether `zip_item_layout` can describe a tensor of this dtype and size."""
    return dtype in _STORAGE_CLASS and nbytes <= _MAX_RECORD


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
    ref = _StorageRef(getattr(torch, _STORAGE_CLASS[dtype]), numel)
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
            self._emit(
                _CENTRAL.pack(
                    b"PK\x01\x02",
                    0,
                    0,
                    _FLAGS,
                    0,
                    0,
                    0,
                    0,
                    size,
                    size,
                    len(raw),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + raw
            )
        size, n = self.pos - start, len(self.entries)
        z64 = self.pos
        self._emit(_ZIP64_EOCD.pack(b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, n, n, size, start))
        self._emit(_ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, z64, 1))
        self._emit(_EOCD.pack(b"PK\x05\x06", 0, 0, n, n, size, start, 0))


def zip_item_layout(
    dtype: torch.dtype, shape: Tuple[int, ...], file_offset: int, data_align: int = 4096
) -> Optional[ZipItemLayout]:
    """The bytes around a tensor's data for an item starting at `file_offset`.

    The data (C-contiguous, `numel * itemsize` bytes) lands at a file offset that is a
    multiple of `data_align`.

    Returns:
        The layout, or None when the tensor is not supported (see `supports`).
    """
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if not supports(dtype, nbytes):
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
