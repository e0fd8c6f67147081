"""Pooled host buffers: chunk pairs for streamed writes, whole-file images for async saves.
Buffers come from `mmap` or shared memory, so they are page-aligned, as O_DIRECT needs;
pools keep a few free ones each. `pin` page-locks a buffer in place (shared memory stays
shared) so device-to-host copies into it run asynchronously; `unpin` must run before its
memory is freed. Without CUDA both are no-ops, so CPU runs take the same code path.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Protocol, Sequence, Tuple

import numpy as np
import torch

__all__ = ["ALIGN", "CHUNK", "ChunkBuffers", "ImagePool", "aligned", "pin", "private", "unpin"]

logger = logging.getLogger(__name__)

#: alignment of O_DIRECT requests (file offsets, lengths and memory)
ALIGN = 4096
#: size of each of a streamed write's two chunk buffers
CHUNK = 64 << 20


def aligned(n: int, align: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `align`."""
    return -(-n // align) * align


def pin(buf: torch.Tensor) -> bool:
    """Page-locks the host memory of `buf` (contiguous, on the CPU).

    Returns:
        Whether the buffer is now pinned. False without CUDA, or where the driver refuses
        (logged; copies into the buffer are then synchronous, still correct).
    """
    if not torch.cuda.is_available():
        return False
    nbytes = buf.numel() * buf.element_size()
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
    except Exception as e:  # a build without cudart bindings
        logger.warning("could not pin a %d-byte staging buffer (%s)", nbytes, e)
        return False
    ok = int(err[0] if isinstance(err, tuple) else err) == 0
    if not ok:
        # the failed call left CUDA's per-thread "last error" set: the next kernel launch of
        # the training step would raise it as its own failure
        _clear_last_cuda_error()
        logger.warning("could not pin a %d-byte staging buffer; copies will be synchronous", nbytes)
    return ok


def _clear_last_cuda_error() -> None:
    """Resets CUDA's last error (best effort): torch has no binding for `cudaGetLastError`,
    and the libcudart mapped into the process is the runtime instance torch uses."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libcudart" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except Exception as e:  # no /proc, or a static runtime: nothing we can reset
        logger.debug("could not reset CUDA's last error: %s", e)


def unpin(buf: torch.Tensor) -> None:
    """Undoes `pin` (call while `buf`'s memory is still alive)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except Exception as e:
        logger.debug("cudaHostUnregister failed: %s", e)


class _Pins:
    """A pool's page-locked buffers by address: each pinned once, unpinned when dropped."""

    def __init__(self) -> None:
        self._bufs: Dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.count = 0  # buffers pinned so far

    def pin(self, buf: torch.Tensor) -> None:
        with self._lock:
            if buf.data_ptr() in self._bufs:
                return
        if pin(buf):
            with self._lock:
                self._bufs[buf.data_ptr()] = buf
                self.count += 1

    def is_pinned(self, buf: torch.Tensor) -> bool:
        with self._lock:
            return buf.data_ptr() in self._bufs

    def unpin(self, bufs: Sequence[torch.Tensor]) -> None:
        with self._lock:
            held = [self._bufs.pop(b.data_ptr(), None) for b in bufs]
        for b in held:
            if b is not None:
                unpin(b)

    def unpin_all(self) -> None:
        self.unpin(list(self._bufs.values()))


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
    _pins = _Pins()
    _lock = threading.Lock()

    @classmethod
    def acquire(cls, pin: bool = False) -> List[np.ndarray]:
        """Two `CHUNK`-byte aligned buffers (page-locked when `pin` and CUDA is available)."""
        with cls._lock:
            bufs = cls._free.pop() if cls._free else None
        if bufs is None:
            bufs = [private(CHUNK) for _ in range(2)]
        if pin:
            for b in bufs:
                cls._pins.pin(torch.from_numpy(b))
        return bufs

    @classmethod
    def is_pinned(cls, buf: np.ndarray) -> bool:
        """Whether `buf` (from `acquire`) is page-locked."""
        return cls._pins.is_pinned(torch.from_numpy(buf))

    @classmethod
    def release(cls, bufs: List[np.ndarray]) -> None:
        """Returns a pair from `acquire` (up to 4 pairs are kept)."""
        with cls._lock:
            if len(cls._free) < 4:
                cls._free.append(bufs)
                return
        cls._pins.unpin([torch.from_numpy(b) for b in bufs])


class Layout(Protocol):
    """What `ImagePool` needs of a file layout."""

    @property
    def size(self) -> int: ...

    @property
    def signature(self) -> Tuple[Any, ...]: ...


class ImagePool:
    """Shared host buffers holding whole file images, reused across saves.

    Buffers are keyed by a layout's `signature` (equal: reusable as is). A save of several
    files takes and returns them as a set (`acquire_group` / `release_group`), so it finds
    all of them again. Buffers for GPU copies are pinned (unpinned when dropped).

    Args:
        max_free: free buffers (or sets) kept per signature (2: a save reuses the images of
            the one before while a third is still written).
        max_signatures: signatures whose free buffers are kept (the last released).

    Attributes:
        allocated_bytes, allocations, pins: bytes alive, buffers allocated, buffers pinned.
    """

    def __init__(self, max_free: int = 2, max_signatures: int = 4) -> None:
        self._free: OrderedDict[Tuple[Any, ...], List[List[torch.Tensor]]] = OrderedDict()
        self._pins = _Pins()
        self._lock = threading.Lock()
        # a pool that goes away (a strategy made per save) must unregister its buffers
        # before their memory is unmapped: the driver keeps a registration of a freed range,
        # and pinning whatever is mapped there next fails
        weakref.finalize(self, self._pins.unpin_all)
        self.max_free = max_free
        self.max_signatures = max_signatures
        self.allocated_bytes = 0
        self.allocations = 0

    @property
    def pins(self) -> int:
        return self._pins.count

    def _new(self, size: int) -> torch.Tensor:
        n = max(ALIGN, aligned(size))
        # straight into shared memory (shareable with the writer process):
        # `share_memory_()` on a new tensor would copy it once more
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is not None:
            buf = torch.empty(0, dtype=torch.uint8).set_(new_shared(n))
        else:  # pragma: no cover - torch builds without it
            buf = torch.empty(n, dtype=torch.uint8).share_memory_()
        with self._lock:
            self.allocated_bytes += n
            self.allocations += 1
        return buf

    def acquire(self, plan: Layout, pin: bool) -> torch.Tensor:
        """A buffer of at least `plan.size` bytes (rounded up to `ALIGN`), pinned if `pin`:
        a free one of the same signature, else a new one."""
        return self.acquire_group([plan], pin)[0]

    def acquire_group(self, plans: Sequence[Layout], pin: bool) -> List[torch.Tensor]:
        """Buffers for `plans` (one each, in order), reusing a set released for equal plans."""
        with self._lock:
            free = self._free.get(tuple(p.signature for p in plans))
            bufs = free.pop() if free else None
        if bufs is None:
            bufs = [self._new(p.size) for p in plans]
        if pin:
            for b in bufs:
                self._pins.pin(b)
        return list(bufs)

    def is_pinned(self, buf: torch.Tensor) -> bool:
        """Whether `buf` (from `acquire`) is page-locked."""
        return self._pins.is_pinned(buf)

    def release(self, plan: Layout, buf: torch.Tensor) -> None:
        """Returns `buf` for reuse by saves of the same signature, or frees it."""
        self.release_group([plan], [buf])

    def release_group(self, plans: Sequence[Layout], bufs: Sequence[torch.Tensor]) -> None:
        """Returns the buffers of `acquire_group(plans, ...)` together, or frees them."""
        if not bufs:
            return
        key = tuple(p.signature for p in plans)
        dropped: List[torch.Tensor] = []
        with self._lock:
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self.max_free:
                free.append(list(bufs))
            else:
                dropped += bufs
            while len(self._free) > self.max_signatures:
                for old in self._free.popitem(last=False)[1]:
                    dropped += old
            for b in dropped:
                self.allocated_bytes -= b.numel()
        self._pins.unpin(dropped)
