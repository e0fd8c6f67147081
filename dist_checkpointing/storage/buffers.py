"""Aligned host buffers, pooled: bounce buffers for direct reads, chunk pairs for streamed
writes, whole-file images for async saves (pinned for CUDA sources), pinned local images.

Pools bound the memory they keep (a few free buffers each); buffers come from `mmap` or
shared memory, so they are page-aligned, as O_DIRECT needs.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Protocol, Tuple

import numpy as np
import torch

from . import pinned as _pinned

__all__ = [
    "ALIGN",
    "BOUNCE",
    "CHUNK",
    "bounce",
    "give_back",
    "ChunkBuffers",
    "ImagePool",
    "host_buffer",
]

#: alignment of O_DIRECT requests (file offsets, lengths and memory)
ALIGN = 4096
#: size of a direct read's bounce buffer
BOUNCE = 32 << 20
#: size of each of a streamed write's two chunk buffers
CHUNK = 64 << 20

_lock = threading.Lock()
_free_bounce: List[np.ndarray] = []


def bounce() -> np.ndarray:
    """An aligned `BOUNCE`-byte buffer (reused); hand it back with `give_back`."""
    with _lock:
        if _free_bounce:
            return _free_bounce.pop()
    return np.frombuffer(mmap.mmap(-1, BOUNCE), dtype=np.uint8)


def give_back(buf: np.ndarray) -> None:
    """Returns a buffer from `bounce` (up to 8 are kept)."""
    with _lock:
        if len(_free_bounce) < 8:
            _free_bounce.append(buf)


class ChunkBuffers:
    """Pairs of page-aligned chunk buffers, reused across saves (one pair per file in flight)."""

    _free: List[List[np.ndarray]] = []
    _lock = threading.Lock()

    @classmethod
    def acquire(cls) -> List[np.ndarray]:
        """Two `CHUNK`-byte aligned buffers."""
        with cls._lock:
            if cls._free:
                return cls._free.pop()
        return [np.frombuffer(mmap.mmap(-1, CHUNK), dtype=np.uint8) for _ in range(2)]

    @classmethod
    def release(cls, bufs: List[np.ndarray]) -> None:
        """Returns a pair from `acquire` (up to 4 pairs are kept)."""
        with cls._lock:
            if len(cls._free) < 4:
                cls._free.append(bufs)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A new uint8 host tensor of `nbytes`, page-locked when `pin` and CUDA is available.

    For buffers that device tensors are copied into and that live as long as their owner
    (local checkpoint images); pinned memory is freed with the tensor.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pin and torch.cuda.is_available():
        return buffer.pin_memory()
    return buffer


class Layout(Protocol):
    """What `ImagePool` needs of a file layout."""

    @property
    def size(self) -> int: ...

    @property
    def signature(self) -> Tuple[Any, ...]: ...


class ImagePool:
    """Shared, page-aligned host buffers holding whole file images, reused across saves.

    Buffers are keyed by a layout's `signature` (equal signatures: same size and item
    placement, so a buffer can be reused as is) and sized by its `size`.

    Buffers that will receive copies from a GPU are page-locked (pinned) so those copies run
    asynchronously; a buffer dropped from the pool is unpinned first. Free buffers are kept
    for the `max_signatures` file layouts released most recently, so host memory stays
    bounded when the saved structure keeps changing.

    Args:
        max_free: free buffers kept per file signature.
        max_signatures: file signatures whose free buffers are kept.
    """

    def __init__(self, max_free: int = 2, max_signatures: int = 4) -> None:
        self._free: OrderedDict[Tuple[Any, ...], List[torch.Tensor]] = OrderedDict()
        self._pinned: Dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._lock = threading.Lock()
        self.max_free = max_free
        self.max_signatures = max_signatures
        #: bytes of the buffers alive (in use or kept free)
        self.allocated_bytes = 0

    def acquire(self, plan: Layout, pin: bool) -> torch.Tensor:
        """A buffer of at least `plan.size` bytes (rounded up to `ALIGN`), pinned if `pin`.

        A free buffer of the same signature is reused; otherwise a new one is allocated.
        """
        buf = None
        with self._lock:
            free = self._free.get(plan.signature)
            if free:
                buf = free.pop()
        if buf is None:
            n = max(ALIGN, -(-plan.size // ALIGN) * ALIGN)
            buf = torch.empty(n, dtype=torch.uint8).share_memory_()  # page-aligned, shareable
            with self._lock:
                self.allocated_bytes += n
        if pin and buf.data_ptr() not in self._pinned and _pinned.pin(buf):
            with self._lock:
                self._pinned[buf.data_ptr()] = buf
        return buf

    def is_pinned(self, buf: torch.Tensor) -> bool:
        """Whether `buf` (from `acquire`) is page-locked."""
        return buf.data_ptr() in self._pinned

    def release(self, plan: Layout, buf: torch.Tensor) -> None:
        """Returns `buf` for reuse by saves of the same signature, or frees it."""
        dropped: List[torch.Tensor] = []
        with self._lock:
            free = self._free.setdefault(plan.signature, [])
            self._free.move_to_end(plan.signature)
            if len(free) < self.max_free:
                free.append(buf)
            else:
                dropped.append(buf)
            while len(self._free) > self.max_signatures:
                dropped += self._free.popitem(last=False)[1]
            for b in dropped:
                self.allocated_bytes -= b.numel()
            was_pinned = [self._pinned.pop(b.data_ptr(), None) for b in dropped]
            unpin = [b for b in was_pinned if b is not None]
        for b in unpin:
            _pinned.unpin(b)
