"""Streaming writers for whole tensors: safetensors files and `torch.save`-compatible zips.

Both formats let the writer lay out the file from shapes and dtypes alone, so tensors can
be written one at a time, each freed before the next is read: memory stays at one tensor.

safetensors: an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, `data_offsets` relative to the data section; padded with spaces to 8 bytes), then
the tensors' bytes back to back.

torch: a stored (uncompressed) zip `<name>/data.pkl` (a pickled dict whose tensors refer
to storages `<name>/data/<i>` by persistent id), `<name>/data/<i>`, `byteorder`, `version`:
what `torch.load` reads.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import struct
import zipfile
from typing import Any, BinaryIO, Dict, List, Tuple

import torch

from ..errors import CheckpointingException
from ..strategies.torch_dist.zipformat import STORAGE_CLASS

__all__ = ["SAFETENSORS_DTYPES", "safetensors_header", "TorchZipWriter", "tensor_bytes"]

SAFETENSORS_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code

_STORAGE: Dict[torch.dtype, str] = STORAGE_CLASS


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def safetensors_header(entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]]) -> bytes:
    """The length prefix and header of a safetensors file holding `entries` in order.

    Raises:
        CheckpointingException: a dtype safetensors cannot store.
    """
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape in entries:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise CheckpointingException(f"{key!r}: safetensors cannot store dtype {dtype}")
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _StorageRef:
    def __init__(self, cls: Any, key: str, numel: int) -> None:
        self.cls, self.key, self.numel = cls, key, numel


class _Rebuild:
    def __init__(self, ref: _StorageRef, shape: Tuple[int, ...]) -> None:
        self.ref, self.shape = ref, shape

    def __reduce__(self):  # type: ignore[no-untyped-def]
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= max(s, 1)
        return (
            torch._utils._rebuild_tensor_v2,
            (self.ref, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict()),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, _StorageRef):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


class TorchZipWriter:
    """Writes `{key: tensor}` as one `torch.save`-compatible file, one tensor at a time.

    Usage: `w = TorchZipWriter(f, entries)`; then `w.write(i, tensor)` for each entry in
    order; then `w.close()`.

    Args:
        f: the destination, opened for binary writing.
        entries: `(key, dtype, shape)` of every tensor, in the order they will be written.

    Raises:
        CheckpointingException: a dtype `torch.save` files here cannot describe.
    """

    def __init__(
        self, f: BinaryIO, entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]]
    ) -> None:
        refs = {}
        for i, (key, dtype, shape) in enumerate(entries):
            name = _STORAGE.get(dtype)
            if name is None:
                raise CheckpointingException(f"{key!r}: cannot write dtype {dtype} as torch")
            refs[key] = _Rebuild(_StorageRef(getattr(torch, name), str(i), math.prod(shape)), shape)
        payload = io.BytesIO()
        _Pickler(payload, protocol=2).dump(refs)
        self._entries = entries
        self._zip = zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._zip.writestr("archive/data.pkl", payload.getvalue())
        self._zip.writestr("archive/byteorder", "little")

    def write(self, index: int, tensor: torch.Tensor) -> None:
        """Writes the data of entry `index` (its dtype and shape must match)."""
        key, dtype, shape = self._entries[index]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointingException(f"{key!r}: tensor does not match its declared entry")
        with self._zip.open(f"archive/data/{index}", "w", force_zip64=True) as out:
            out.write(tensor_bytes(tensor))

    def close(self) -> None:
        """Finishes the file (version record and zip directory)."""
        self._zip.writestr("archive/version", "3\n")
        self._zip.close()
