"""The byte image of one local checkpoint part (docs/formats.md): raw tensor bytes, a safe
header, checksums. Replicas are byte-identical to the owner's file."""

from __future__ import annotations

import io
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch

from .._safe_load import torch_load
from ..errors import CheckpointCorruptedError, CheckpointingException
from ..integrity import checksum
from ..storage import ALIGN, ImagePool, faults, write_segments
from ..storage import read_file as read_image  # the name tools/_storage.py reads parts by
from .base_state_dict import TensorAwareStateDict, hollow_state_classes
from .basic_state_dict import BasicTensorAwareStateDict  # noqa: F401  (registers its classes)

__all__ = [
    "LocalImage",
    "start_image",
    "finish_image",
    "release_image",
    "decode_image",
    "read_image",
    "map_image",
    "is_mapped",
    "write_image",
]

MAGIC = b"DCLCKPT1"
FORMAT_VERSION = 1
_FOOTER = struct.Struct("<8sQQQQQ")
_ALIGN = 64
_POOL_GRANULE = 1 << 20  # sizes rounded up to this, so equal structures share buffers

#: pooled, page-aligned image buffers (pinned when filled from CUDA), reused across saves
_POOL = ImagePool(max_free=1, max_signatures=2)

# torch's `safe_globals` context swaps a process-wide set and restores its own snapshot on
# exit: two threads inside it at once can each drop the other's classes. One at a time.
_HEADER_LOCK = threading.Lock()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(size: int) -> Any:
    """The `ImagePool` layout of a buffer of `size` bytes."""
    return SimpleNamespace(size=size, signature=("local", size))


def load_header(data: bytes, what: str, weights_only: bool = True) -> Any:
    """Unpickles a verified header with the hollow-state classes allowed (`what`: for errors)."""
    with _HEADER_LOCK, torch.serialization.safe_globals(list(hollow_state_classes())):  # type: ignore[arg-type]
        return torch_load(io.BytesIO(data), what, weights_only)


@dataclass
class LocalImage:
    """A local checkpoint part: its tensors' bytes (`sources`) and header, checksum table and
    footer (`tail`), staged in one host `buffer` or (unstaged) in the tensors' own memory."""

    ckpt_id: Tuple[Any, ...]
    buffer: Optional[torch.Tensor]  # uint8, 1-D, the whole image; None when unstaged
    slots: List[Tuple[int, int]]  # (offset, nbytes) per tensor
    header_offset: int
    header_len: int
    sources: List[np.ndarray]  # per tensor, its bytes
    tail: np.ndarray  # header + table + footer
    finished: bool = False
    pooled: Optional[torch.Tensor] = None  # the pool buffer behind `buffer`

    @property
    def nbytes(self) -> int:
        return self.header_offset + int(self.tail.size)

    def segments(self) -> List[np.ndarray]:
        """The image's bytes as consecutive flat uint8 arrays."""
        if self.buffer is not None:
            return [self.buffer.numpy()]
        out: List[np.ndarray] = []
        for (off, n), src in zip(self.slots, self.sources):
            out.append(src)
            if _aligned(off + n) > off + n:
                out.append(np.zeros(_aligned(off + n) - (off + n), dtype=np.uint8))
        out.append(self.tail)
        return out

    def padded(self) -> Optional[np.ndarray]:
        """The staged buffer extended with zeros to a multiple of 4096 (for O_DIRECT)."""
        if self.pooled is None:
            return None
        n = -(-self.nbytes // ALIGN) * ALIGN
        flat = self.pooled.numpy()
        flat[self.nbytes : n] = 0
        return flat[:n]


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes without a copy (made contiguous first if it is not)."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def release_image(image: LocalImage) -> None:
    """Returns a staged image's pooled buffer for reuse (the image must not be used again)."""
    if image.pooled is not None:
        pooled, image.pooled, image.buffer = image.pooled, None, None
        _POOL.release(_layout(int(pooled.numel())), pooled)


def start_image(
    state: TensorAwareStateDict,
    ckpt_id: Tuple[Any, ...],
    names: Optional[List[str]] = None,
    stage: bool = True,
) -> LocalImage:
    """Copies `state` (unchanged) into an unfinished image; with `stage` into a pooled buffer
    (the caller may modify its tensors at once), else CPU tensors are referenced in place.
    CheckpointingException if the hollow state cannot be serialized."""
    tensors = state.pop_tensors()
    try:
        slots, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append((offset, nbytes))
            offset = _aligned(offset + nbytes)
        header = {
            "format": FORMAT_VERSION,
            "id": tuple(ckpt_id),
            "state": state,
            "tensors": [
                (off, n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                for (off, n), t in zip(slots, tensors)
            ],
            "names": list(names) if names is not None else None,
        }
        raw = io.BytesIO()
        try:
            torch.save(header, raw)
        except Exception as e:
            raise CheckpointingException(
                f"Cannot serialize the non-tensor part of local checkpoint {ckpt_id}: {e}"
            ) from e
    finally:
        state.insert_tensors(tensors)
    header_bytes = np.frombuffer(raw.getbuffer(), dtype=np.uint8)
    h_off, h_len = offset, header_bytes.size
    total = h_off + h_len + 8 * len(tensors) + _FOOTER.size
    on_cuda = any(t.is_cuda for t in tensors)
    if not stage and not on_cuda:
        tail = np.zeros(total - h_off, dtype=np.uint8)
        tail[:h_len] = header_bytes
        sources = [_byte_view(t) for t in tensors]
        return LocalImage(tuple(ckpt_id), None, slots, h_off, h_len, sources, tail)
    rounded = -(-(total + ALIGN) // _POOL_GRANULE) * _POOL_GRANULE
    pooled = _POOL.acquire(_layout(rounded), pin=on_cuda)
    buffer = pooled[:total]
    for (off, n), t in zip(slots, tensors):
        if n:
            buffer[off : off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda)
        # zero the alignment padding: a reused buffer holds an earlier image's bytes
        buffer[off + n : _aligned(off + n)].zero_()
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
    flat = buffer.numpy()
    flat[h_off : h_off + h_len] = header_bytes
    sources = [flat[off : off + n] for off, n in slots]
    return LocalImage(
        tuple(ckpt_id), buffer, slots, h_off, h_len, sources, flat[h_off:], pooled=pooled
    )


def finish_image(image: LocalImage) -> LocalImage:
    """Computes the checksums and writes the footer; returns `image`."""
    if image.finished:
        return image
    tail = image.tail
    table = np.array([checksum(p) for p in image.sources], dtype="<u8").view(np.uint8)
    t0, t1 = image.header_len, image.header_len + table.size
    tail[t0:t1] = table
    footer = _FOOTER.pack(
        MAGIC,
        image.header_offset,
        image.header_len,
        len(image.slots),
        checksum(tail[:t0]),
        checksum(tail[t0:t1]),
    )
    tail[t1:] = np.frombuffer(footer, dtype=np.uint8)
    image.finished = True
    return image


def decode_image(
    buffer: torch.Tensor, where: str, verify: bool = True, weights_only: bool = True
) -> Tuple[Tuple[Any, ...], TensorAwareStateDict]:
    """Parses and checks an image: `(ckpt_id, state)`, tensors viewing `buffer`; `verify`
    checks tensor checksums. CheckpointCorruptedError when malformed or mismatched,
    UnsafeCheckpointError when the header holds objects outside the allowlist."""
    flat = buffer.numpy()
    size = flat.size
    if size < _FOOTER.size:
        raise CheckpointCorruptedError(f"{where}: {size} bytes, too short for a local checkpoint")
    magic, h_off, h_len, count, h_sum, t_sum = _FOOTER.unpack(flat[size - _FOOTER.size :].tobytes())
    if magic != MAGIC:
        raise CheckpointCorruptedError(f"{where}: not a local checkpoint file (bad magic)")
    t_off = h_off + h_len
    if t_off + 8 * count + _FOOTER.size != size:
        raise CheckpointCorruptedError(f"{where}: inconsistent sizes in the footer (truncated?)")
    if checksum(flat[h_off:t_off]) != h_sum:
        raise CheckpointCorruptedError(f"{where}: header checksum mismatch (bytes {h_off}-{t_off})")
    table = flat[t_off : t_off + 8 * count]
    if checksum(table) != t_sum:
        raise CheckpointCorruptedError(f"{where}: checksum table mismatch")
    sums = table.view("<u8")
    header = load_header(flat[h_off:t_off].tobytes(), f"{where} (header)", weights_only)
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise CheckpointCorruptedError(
            f"{where}: unsupported local checkpoint header (format "
            f"{header.get('format') if isinstance(header, dict) else type(header).__name__!r})"
        )
    state, entries, names = header.get("state"), header.get("tensors"), header.get("names")
    if not isinstance(state, TensorAwareStateDict) or not isinstance(entries, list):
        raise CheckpointCorruptedError(f"{where}: malformed header")
    if len(entries) != count:
        raise CheckpointCorruptedError(
            f"{where}: header lists {len(entries)} tensors, footer {count}"
        )
    tensors = []
    for i, entry in enumerate(entries):
        label = names[i] if isinstance(names, list) and i < len(names) else f"#{i}"
        try:
            off, n, dtype_name, shape = entry
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            if not isinstance(dtype, torch.dtype):
                raise CheckpointCorruptedError(
                    f"{where}: unknown dtype {dtype_name!r} in the header"
                )
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            valid = isinstance(off, int) and isinstance(n, int) and 0 <= off
            valid = valid and off + n <= h_off and n == numel * dtype.itemsize and off % _ALIGN == 0
        except (TypeError, ValueError) as e:
            raise CheckpointCorruptedError(f"{where}: malformed entry for tensor {label}") from e
        if not valid:
            raise CheckpointCorruptedError(f"{where}: invalid byte range for tensor {label}")
        if verify and checksum(flat[off : off + n]) != int(sums[i]):
            raise CheckpointCorruptedError(
                f"{where}: checksum mismatch in tensor {label} (bytes {off}-{off + n})"
            )
        data = buffer[off : off + n]
        tensors.append(
            data.view(dtype).view(tuple(shape)) if n else torch.empty(shape, dtype=dtype)
        )
    try:
        state.insert_tensors(tensors)
    except CheckpointingException as e:
        raise CheckpointCorruptedError(f"{where}: {e}") from e
    return tuple(header.get("id", ())), state


#: the live mappings of `map_image`, each with the (device, inode) of the file it maps
_MAPPED: weakref.WeakKeyDictionary[mmap.mmap, Tuple[int, int]] = weakref.WeakKeyDictionary()
_MAPPED_LOCK = threading.Lock()  # a load may map while a background save asks `is_mapped`


def map_image(path: str) -> torch.Tensor:
    """A part file as a uint8 tensor mapping it copy-on-write, for `decode_image`: a load
    then reads the page cache's pages where they are, instead of copying them into fresh
    memory. Writes to the tensor stay private and unlinking the file does not disturb it;
    writing the file in place would, so a part is never recycled while `is_mapped`.

    Raises:
        OSError: the file cannot be opened (FileNotFoundError when missing) or mapped.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        faults.check("read", path, 0, st.st_size, False)
        if st.st_size == 0:  # mmap refuses an empty file (decode_image refuses it too)
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    with _MAPPED_LOCK:
        _MAPPED[mapped] = (st.st_dev, st.st_ino)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # its views keep `mapped` alive


def is_mapped(path: Union[str, os.PathLike]) -> bool:
    """Whether a tensor of this process still maps the file `path` (`map_image`)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    with _MAPPED_LOCK:
        return (st.st_dev, st.st_ino) in set(_MAPPED.values())


def write_image(image: LocalImage, path: str, fsync: bool = True, overwrite: bool = False) -> None:
    """Writes an image to the new file `path` (over it with `overwrite`); with `fsync`,
    O_DIRECT where possible, then fsync'd. FileExistsError, or OSError (no partial file)."""
    finish_image(image)
    write_segments(
        path,
        image.segments(),
        direct=fsync,
        fsync=fsync,
        overwrite=overwrite,
        padded=image.padded(),
    )
