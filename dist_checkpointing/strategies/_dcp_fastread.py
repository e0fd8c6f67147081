"""Reading a stored tensor chunk without `torch.load`: straight into the destination.

Each tensor item of a DCP data file is a `torch.save` zip (stored, uncompressed). Its
`data.pkl` says which storage record holds the data and with what offset, shape and
strides; for a C-contiguous chunk the bytes can be read with one `readinto`, directly into
the destination tensor when the request covers the whole chunk. The pickle is read with
an unpickler that knows only the tensor-rebuild recipe (nothing is executed). Anything
unexpected returns None and the caller falls back to `torch.load`.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

__all__ = ["ChunkLayout", "chunk_layout", "read_into"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


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


def _recipe(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> _Recipe:
    return _Recipe(storage, int(offset), tuple(size), tuple(stride))


class _RecipeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _recipe
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (
            module == "torch"
            and name.endswith("Storage")
            and isinstance(getattr(torch, name, None), type)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        tag, storage_type, key, _location, numel = pid
        if tag != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {tag!r}")
        name = storage_type.__name__ if isinstance(storage_type, type) else str(storage_type)
        return _Storage(str(key), _STORAGE_DTYPES[name], int(numel))


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _record_start(item: io.RawIOBase, info: zipfile.ZipInfo) -> Optional[int]:
    """Offset of a stored record's data (read from its local header), or None."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    item.seek(info.header_offset)
    header = _LOCAL_HEADER.unpack(item.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        return None
    return info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]


def chunk_layout(item: io.RawIOBase) -> Optional[ChunkLayout]:
    """Locates the contiguous data of a `torch.save`d tensor item, or None if it cannot.

    Args:
        item: a seekable binary view of exactly one item.
    """
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
        if recipe.stride != _contiguous_strides(recipe.shape) and math.prod(recipe.shape) > 1:
            return None
        info = zf.getinfo(f"{pkl[: -len('data.pkl')]}data/{recipe.storage.key}")
        start = _record_start(item, info)
        if start is None:
            return None
        layout = ChunkLayout(
            start + recipe.offset * recipe.storage.dtype.itemsize,
            recipe.storage.dtype,
            recipe.shape,
        )
        if recipe.offset * recipe.storage.dtype.itemsize + layout.nbytes > info.file_size:
            return None
        return layout
    except (
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        StopIteration,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
        struct.error,
        EOFError,
    ):
        return None


def read_into(item: io.RawIOBase, layout: ChunkLayout, dest: torch.Tensor) -> bool:
    """Reads the chunk into `dest` (same shape and dtype, contiguous, on the CPU).

    Returns:
        False if `dest` does not qualify (nothing was read).
    """
    if (
        tuple(dest.shape) != layout.shape
        or dest.dtype != layout.dtype
        or not dest.is_contiguous()
        or dest.device.type != "cpu"
    ):
        return False
    if layout.nbytes == 0:
        return True
    view = memoryview(dest.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    item.seek(layout.data_offset)
    done = 0
    while done < layout.nbytes:
        got = item.readinto(view[done:])
        if not got:
            raise EOFError(f"short read: {done} of {layout.nbytes} bytes")
        done += got
    return True
