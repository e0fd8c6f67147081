"""Reading a local checkpoint part at disk speed, verified as it lands.

`read_part` reads the small end of the file first (footer, header, checksum table), then
the tensor bytes in large requests through the shared read path (`storage.read_region`:
O_DIRECT or the page cache as measured per file system, huge pages for fresh memory), and
hashes each tensor's bytes request by request while they are still in the CPU caches, so
a load makes one pass over memory instead of a read and then a verification pass.

The destination is fresh host memory (the loaded CPU tensors are views of it), or, when
every tensor of the part goes back to CUDA, a pooled page-locked buffer (the same pool the
saves stage into), from which the device copies run asynchronously; it is handed back with
`release_part` once the copies are done.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from .._safe_load import torch_load
from ..errors import CheckpointCorruptedError
from ..integrity import checksum, new_hasher
from ..storage import ALIGN, prefer_direct_reads, read_region
from ._image import _FOOTER, _POOL, _POOL_GRANULE, FORMAT_VERSION, MAGIC, _Layout
from .base_state_dict import hollow_state_classes

__all__ = ["Part", "read_part", "release_part"]

#: bytes per read request (each request's bytes are hashed at once)
REQUEST = 8 << 20


@dataclass
class Part:
    """A part's bytes, its tensors verified.

    `pooled` is the pool buffer behind `buffer` (a page-locked one, for CUDA destinations),
    or None for fresh memory.
    """

    buffer: torch.Tensor
    pooled: Optional[torch.Tensor] = None


def release_part(part: Part) -> None:
    """Hands a pooled part buffer back (nothing may view it afterwards)."""
    if part.pooled is not None:
        pooled, part.pooled = part.pooled, None
        _POOL.release(_Layout(int(pooled.numel())), pooled)


def _devices(state: Any) -> List[str]:
    """The devices the part's tensors were saved from (both state classes record them)."""
    devices = getattr(state, "_devices", None)
    if devices is None and hasattr(state, "placeholders"):
        devices = [h.device for h in state.placeholders()]
    return [str(d) for d in devices or []]


class _Hashes:
    """Hashes each tensor's bytes as the read fills the buffer, then checks its digest."""

    def __init__(
        self,
        flat: np.ndarray,
        slots: List[Tuple[int, int]],
        sums: np.ndarray,
        where: str,
        names: Any,
    ) -> None:
        self.flat, self.slots, self.sums, self.where, self.names = flat, slots, sums, where, names
        self.i, self.done, self.hasher = 0, 0, new_hasher()

    def __call__(self, filled: int) -> None:
        while self.i < len(self.slots):
            off, n = self.slots[self.i]
            lo, hi = max(self.done, off), min(filled, off + n)
            if hi > lo:
                self.hasher.update(self.flat[lo:hi])
            if filled < off + n:
                break
            if self.hasher.intdigest() != int(self.sums[self.i]):
                label = (
                    self.names[self.i]
                    if isinstance(self.names, list) and self.i < len(self.names)
                    else f"#{self.i}"
                )
                raise CheckpointCorruptedError(
                    f"{self.where}: checksum mismatch in tensor {label} (bytes {off}-{off + n})"
                )
            self.hasher.reset()
            self.i += 1
        self.done = max(self.done, filled)


def read_part(path: str, own: bool = True) -> Part:
    """Reads a part file and verifies every tensor's checksum as its bytes arrive.

    Args:
        path: the file.
        own: the part is loaded here (not only sent to another rank): a part whose tensors
            all go back to CUDA is read into a pooled page-locked buffer.

    Returns:
        The part; `decode_image(part.buffer, ..., verify=False)` parses it.

    Raises:
        FileNotFoundError: the file is missing.
        OSError: it cannot be opened.
        CheckpointCorruptedError: it is truncated, malformed or fails a checksum.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _FOOTER.size:
            raise CheckpointCorruptedError(
                f"{path}: {size} bytes, too short for a local checkpoint"
            )
        magic, h_off, h_len, count, h_sum, t_sum = _FOOTER.unpack(
            os.pread(fd, _FOOTER.size, size - _FOOTER.size)
        )
        table_off = h_off + h_len
        if magic != MAGIC or table_off + 8 * count + _FOOTER.size != size:
            raise CheckpointCorruptedError(f"{path}: not a local checkpoint file, or truncated")
        end = os.pread(fd, size - h_off, h_off)
    finally:
        os.close(fd)
    if len(end) != size - h_off:
        raise CheckpointCorruptedError(f"{path}: file shrank while reading")
    header_bytes, table = end[:h_len], np.frombuffer(end[h_len : h_len + 8 * count], "<u8")
    if checksum(header_bytes) != h_sum or checksum(table) != t_sum:
        raise CheckpointCorruptedError(f"{path}: header or checksum table mismatch")
    with torch.serialization.safe_globals(list(hollow_state_classes())):  # type: ignore[arg-type]
        header = torch_load(io.BytesIO(header_bytes), f"{path} (header)", True)
    entries = header.get("tensors") if isinstance(header, dict) else None
    if header.get("format") != FORMAT_VERSION or not isinstance(entries, list):
        raise CheckpointCorruptedError(f"{path}: unsupported local checkpoint header")
    try:
        slots = [(int(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError) as e:
        raise CheckpointCorruptedError(f"{path}: malformed tensor entries") from e
    if len(slots) != count or any(o < 0 or n < 0 or o + n > h_off for o, n in slots):
        raise CheckpointCorruptedError(f"{path}: invalid tensor byte ranges")
    devices = _devices(header.get("state"))
    to_cuda = own and bool(devices) and all(d.startswith("cuda") for d in devices)
    pooled: Optional[torch.Tensor] = None
    if to_cuda and torch.cuda.is_available():
        rounded = -(-(size + ALIGN) // _POOL_GRANULE) * _POOL_GRANULE
        pooled = _POOL.acquire(_Layout(rounded), pin=True)
        buffer = pooled[:size]
    else:  # fresh memory, page-aligned (O_DIRECT reads land in place)
        spare = torch.empty(size + ALIGN, dtype=torch.uint8)
        skip = (-spare.data_ptr()) % ALIGN
        buffer = spare[skip : skip + size]
    flat = buffer.numpy()
    try:
        hashes = _Hashes(flat, slots, table, path, header.get("names"))
        read_region(path, 0, flat[:h_off], prefer_direct_reads(path), hashes, REQUEST)
        hashes(h_off)
        if hashes.i != len(slots):
            raise CheckpointCorruptedError(f"{path}: tensor byte ranges out of order")
        flat[h_off:] = np.frombuffer(end, dtype=np.uint8)
    except BaseException:
        if pooled is not None:
            _POOL.release(_Layout(int(pooled.numel())), pooled)
        raise
    return Part(buffer, pooled)
