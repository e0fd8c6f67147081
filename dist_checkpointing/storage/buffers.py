"""Aligned host buffers, pooled: chunk pairs for streamed writes, whole-file images for async
saves (pinned for CUDA sources), pinned local images.

Pools bound the memory they keep (a few free buffers each); buffers come from `mmap` or
shared memory, so they are page-aligned, as O_DIRECT needs.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Protocol, Sequence, Tuple

import numpy as np
import torch

from . import pinned as _pinned

__all__ = [
    "ALIGN",
    "CHUNK",
    "ChunkBuffers",
    "ImagePool",
    "host_buffer",
    "private",
]

#: alignment of O_DIRECT requests (file offsets, lengths and memory)
ALIGN = 4096
#: size of each of a streamed write's two chunk buffers
CHUNK = 64 << 20


def private(nbytes: int) -> np.ndarray:
    """A private, page-aligned buffer of `nbytes` (freed with the array): a forked child
    that takes a buffer its parent pooled gets its own copy of the pages."""
    return np.frombuffer(
        mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
        dtype=np.uint8,
    )[:nbytes]


class ChunkBuffers:
    """Pairs of private page-aligned chunk buffers, reused across saves (one per file in
    flight); pinned once by `acquire(pin=True)`, unpinned when dropped from the pool."""

    _free: List[List[np.ndarray]] = []
    _pinned: Dict[int, np.ndarray] = {}  # address -> buffer
    _lock = threading.Lock()

    @classmethod
    def acquire(cls, pin: bool = False) -> List[np.ndarray]:
        """Two `CHUNK`-byte aligned buffers (page-locked when `pin` and CUDA is available)."""
        bufs = None
        with cls._lock:
            if cls._free:
                bufs = cls._free.pop()
        if bufs is None:
            bufs = [private(CHUNK) for _ in range(2)]
        if pin:
            for b in bufs:
                addr = b.ctypes.data
                with cls._lock:
                    if addr in cls._pinned:
                        continue
                if _pinned.pin(torch.from_numpy(b)):
                    with cls._lock:
                        cls._pinned[addr] = b
        return bufs

    @classmethod
    def is_pinned(cls, buf: np.ndarray) -> bool:
        """Whether `buf` (from `acquire`) is page-locked."""
        with cls._lock:
            return buf.ctypes.data in cls._pinned

    @classmethod
    def release(cls, bufs: List[np.ndarray]) -> None:
        """Returns a pair from `acquire` (up to 4 pairs are kept)."""
        with cls._lock:
            if len(cls._free) < 4:
                cls._free.append(bufs)
                return
            unpin = [b for b in bufs if cls._pinned.pop(b.ctypes.data, None) is not None]
        for b in unpin:
            _pinned.unpin(torch.from_numpy(b))


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A new uint8 host tensor of `nbytes`, page-locked when `pin` and CUDA is available
    (freed with the tensor)."""
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


def _unpin_all(pinned: Dict[int, torch.Tensor], lock: threading.Lock) -> None:
    with lock:
        bufs = list(pinned.values())
        pinned.clear()
    for b in bufs:
        _pinned.unpin(b)


class ImagePool:
    """Shared, page-aligned host buffers holding whole file images, reused across saves.

    Buffers are keyed by a layout's `signature` (equal: reusable as is) and sized by its
    `size`. A save of several files takes and returns their buffers as a set
    (`acquire_group` / `release_group`), so it finds all of them again. Buffers for GPU
    copies are pinned (unpinned when dropped); free ones are kept for the `max_signatures`
    layouts released most recently.

    Args:
        max_free: free buffers (or sets) kept per signature (2: a save reuses the images of
            the one before while a third is still written).
        max_signatures: signatures whose free buffers are kept.

    Attributes:
        allocated_bytes, allocations, pins: bytes alive, buffers allocated, buffers pinned.
    """

    def __init__(self, max_free: int = 2, max_signatures: int = 4) -> None:
        self._free: OrderedDict[Tuple[Any, ...], List[Any]] = OrderedDict()
        self._pinned: Dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._lock = threading.Lock()
        # a pool that goes away (a strategy made per save) must unregister its buffers
        # before their memory is unmapped: the driver keeps a registration of a freed range,
        # and pinning whatever is mapped there next fails
        weakref.finalize(self, _unpin_all, self._pinned, self._lock)
        self.max_free = max_free
        self.max_signatures = max_signatures
        self.allocated_bytes = 0
        self.allocations = 0
        self.pins = 0

    def _take(self, key: Tuple[Any, ...]) -> Any:
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def _new(self, size: int) -> torch.Tensor:
        n = max(ALIGN, -(-size // ALIGN) * ALIGN)
        # allocated in shared memory directly (page-aligned, shareable with the writer
        # process); `share_memory_()` on a new tensor would copy it once more
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is not None:
            buf = torch.empty(0, dtype=torch.uint8).set_(new_shared(n))
        else:  # pragma: no cover - torch builds without it
            buf = torch.empty(n, dtype=torch.uint8).share_memory_()
        with self._lock:
            self.allocated_bytes += n
            self.allocations += 1
        return buf

    def _pin(self, buf: torch.Tensor) -> None:
        with self._lock:
            if buf.data_ptr() in self._pinned:
                return
        if _pinned.pin(buf):
            with self._lock:
                self._pinned[buf.data_ptr()] = buf
                self.pins += 1

    def acquire(self, plan: Layout, pin: bool) -> torch.Tensor:
        """A buffer of at least `plan.size` bytes (rounded up to `ALIGN`), pinned if `pin`.

        A free buffer of the same signature is reused; otherwise a new one is allocated.
        """
        buf = self._take(plan.signature)
        if buf is None:
            buf = self._new(plan.size)
        if pin:
            self._pin(buf)
        return buf

    def acquire_group(self, plans: Sequence[Layout], pin: bool) -> List[torch.Tensor]:
        """Buffers for `plans` (one each, in order), reusing a set released for equal plans.

        Give them back with `release_group(plans, buffers)`.
        """
        bufs = self._take(self._group_key(plans))
        if bufs is None:
            bufs = [self._new(p.size) for p in plans]
        if pin:
            for b in bufs:
                self._pin(b)
        return list(bufs)

    @staticmethod
    def _group_key(plans: Sequence[Layout]) -> Tuple[Any, ...]:
        return ("group",) + tuple(p.signature for p in plans)

    def is_pinned(self, buf: torch.Tensor) -> bool:
        """Whether `buf` (from `acquire`) is page-locked."""
        with self._lock:
            return buf.data_ptr() in self._pinned

    def release(self, plan: Layout, buf: torch.Tensor) -> None:
        """Returns `buf` for reuse by saves of the same signature, or frees it."""
        self._keep(plan.signature, buf, [buf])

    def release_group(self, plans: Sequence[Layout], bufs: Sequence[torch.Tensor]) -> None:
        """Returns the buffers of `acquire_group(plans, ...)` together, or frees them."""
        if bufs:
            self._keep(self._group_key(plans), list(bufs), list(bufs))

    def _keep(self, key: Tuple[Any, ...], entry: Any, bufs: List[torch.Tensor]) -> None:
        """Keeps `entry` (a buffer or a list of them) free under `key`, within the bounds."""
        dropped: List[torch.Tensor] = []
        with self._lock:
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self.max_free:
                free.append(entry)
            else:
                dropped += bufs
            while len(self._free) > self.max_signatures:
                for old in self._free.popitem(last=False)[1]:
                    dropped += old if isinstance(old, list) else [old]
            for b in dropped:
                self.allocated_bytes -= b.numel()
            was_pinned = [self._pinned.pop(b.data_ptr(), None) for b in dropped]
            unpin = [b for b in was_pinned if b is not None]
        for b in unpin:
            _pinned.unpin(b)
