"""Host staging buffers for async save: reusable, shared, aligned, pinned for CUDA sources.

A save of a given structure (the shapes and dtypes of the tensors it writes) copies every
tensor into one flat host buffer. The buffer is shared memory, so a persistent writer
process can use it without a copy, and each tensor's region starts on a 4096-byte boundary.
When a source tensor is on a GPU the buffer is page-locked (pinned) so device-to-host copies
run asynchronously at full speed; the copy is complete before `stage` returns, because the
caller may modify its tensors as soon as `save` returns. Buffers are reused by later saves
of the same structure once the save that used them is finalized, so host memory does not
grow with the number of saves.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

__all__ = ["TensorSlot", "StagingBuffer", "HostBufferPool", "slot_view"]

logger = logging.getLogger(__name__)

ALIGN = 4096
StructureKey = Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a flat staging buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: Tuple[int, ...]


def _layout(key: StructureKey) -> Tuple[List[TensorSlot], int]:
    slots, offset = [], 0
    for shape, dtype in key:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        slots.append(TensorSlot(offset, nbytes, dtype, shape))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


def slot_view(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """A tensor over `slot`'s bytes of `flat` that owns a storage of exactly those bytes.

    (`torch.save` writes a tensor's whole storage; a plain view would drag the whole buffer.)
    """
    region = flat.numpy()[slot.offset : slot.offset + slot.nbytes]
    return torch.from_numpy(region).view(slot.dtype).view(slot.shape)


class StagingBuffer:
    """One flat shared host buffer laid out for a structure."""

    def __init__(self, key: StructureKey, pin: bool) -> None:
        self.key = key
        self.slots, self.nbytes = _layout(key)
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8).share_memory_()
        self.pinned = pin and _pin(self.flat)

    def views(self) -> List[torch.Tensor]:
        """One tensor per slot, each owning exactly its bytes of the buffer."""
        return [slot_view(self.flat, s) for s in self.slots]

    def release_pages(self) -> None:
        """Unpins the buffer (before it is dropped)."""
        if self.pinned:
            _unpin(self.flat)
            self.pinned = False


def _pin(flat: torch.Tensor) -> bool:
    """Page-locks a shared buffer for fast async device-to-host copies (CUDA only)."""
    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
        ok = int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
    except Exception as e:  # an old driver or a build without cudart: fall back to pageable
        logger.warning("could not pin the staging buffer (%s); copies will be synchronous", e)
        return False
    return ok


def _unpin(flat: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    except Exception as e:
        logger.debug("cudaHostUnregister failed: %s", e)


class HostBufferPool:
    """Staging buffers kept per structure and reused across saves.

    Args:
        max_free_per_key: free buffers kept for one structure (one per outstanding save).
        max_keys: structures kept; the least recently used is dropped beyond this.
    """

    def __init__(self, max_free_per_key: int = 2, max_keys: int = 4) -> None:
        self._free: OrderedDict[StructureKey, List[StagingBuffer]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_free_per_key = max_free_per_key
        self.max_keys = max_keys
        self.allocated_bytes = 0

    @staticmethod
    def structure_key(tensors: Sequence[torch.Tensor]) -> StructureKey:
        """The (shape, dtype) sequence that buffers are laid out and reused by."""
        return tuple((tuple(t.shape), t.dtype) for t in tensors)

    def acquire(self, key: StructureKey, pin: bool) -> StagingBuffer:
        """A free buffer for `key`, or a new one."""
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                return free.pop()
        buf = StagingBuffer(key, pin)
        self.allocated_bytes += buf.nbytes
        logger.debug(
            "allocated a %d-byte staging buffer (%d bytes in all)", buf.nbytes, self.allocated_bytes
        )
        return buf

    def release(self, buf: StagingBuffer) -> None:
        """Returns a buffer once the save that used it is finalized (or failed)."""
        dropped: List[StagingBuffer] = []
        with self._lock:
            free = self._free.setdefault(buf.key, [])
            self._free.move_to_end(buf.key)
            if len(free) < self.max_free_per_key:
                free.append(buf)
            else:
                dropped.append(buf)
            while len(self._free) > self.max_keys:
                _, old = self._free.popitem(last=False)
                dropped += old
        for d in dropped:
            d.release_pages()
            self.allocated_bytes -= d.nbytes

    def stage(self, tensors: Sequence[torch.Tensor]) -> StagingBuffer:
        """Copies `tensors` into a buffer; returns once every copy is complete."""
        key = self.structure_key(tensors)
        on_gpu = any(t.is_cuda for t in tensors)
        buf = self.acquire(key, pin=on_gpu)
        try:
            for dst, src in zip(buf.views(), tensors):
                dst.copy_(src.detach(), non_blocking=src.is_cuda and buf.pinned)
            if on_gpu:
                devices: Dict[int, None] = {t.device.index or 0: None for t in tensors if t.is_cuda}
                for d in devices:
                    torch.cuda.current_stream(d).synchronize()
        except BaseException:
            self.release(buf)
            raise
        return buf
