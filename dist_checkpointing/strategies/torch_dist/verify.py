"""Verifying stored chunks as their bytes are read (no second pass): an item's `ItemSum`
(`integrity`) is one digest of the whole item, or a digest of its frame (the zip records)
plus one per `block` bytes of its data (`ChunkVerifier`)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CheckpointCorruptedError
from ...integrity import ItemSum, new_hasher
from ...storage import read_region

__all__ = ["ChunkVerifier", "check_layout", "flat_bytes", "frame_matches", "mismatch", "read_exact"]

#: edge bytes are hashed this many at a time: glibc keeps freed block-sized buffers mapped
_EDGE_PIECE = 256 << 10


def mismatch(what: str, info: _StorageInfo, span: str = "") -> CheckpointCorruptedError:
    """The error for an item (or its part `span` names) whose bytes do not match their digest."""
    span = span or f"bytes {info.offset}-{info.offset + info.length}"
    return CheckpointCorruptedError(
        f"{what}: checksum mismatch in {span} of {info.relative_path}: the stored data is damaged"
    )


def check_layout(
    layout: Any, stored: Optional[Tuple[Tuple[int, ...], torch.dtype]], what: str
) -> None:
    """Raises `CheckpointCorruptedError` where a chunk's zip records (`layout`) say another
    shape or dtype than the metadata (`stored`; None: not recorded) does."""
    if stored is not None and stored != (tuple(layout.shape), layout.dtype):
        raise CheckpointCorruptedError(
            f"{what}: the item holds a {layout.dtype} chunk of shape "
            f"{tuple(layout.shape)}, the metadata says {stored[1]} of shape {stored[0]}"
        )


def read_exact(raw: Any, offset: int, n: int) -> bytes:
    """`n` bytes of the item from `offset` (fewer only at the item's end)."""
    raw.seek(offset)
    parts, got = [], 0
    while got < n:
        part = raw.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def frame_matches(raw: Any, layout: Any, length: int, expected: ItemSum) -> bool:
    """Whether the item's zip records (all bytes around the data) match their digest."""
    if layout.data_offset != expected.data_off or layout.nbytes != expected.data_len:
        return False
    end = layout.data_offset + layout.nbytes
    h = new_hasher()
    h.update(read_exact(raw, 0, layout.data_offset))
    h.update(read_exact(raw, end, length - end))
    return h.intdigest() == expected.digest


def flat_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes as a flat uint8 numpy view (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


class ChunkVerifier:
    """Reads bytes `[start, start + len(data))` of a chunk's data region into `data` (`read`),
    verifying them as they land: each completed block (or a whole-item digest, fed) while
    still in the CPU caches. The edge blocks' bytes outside the range are read from `raw` and
    hashed `_EDGE_PIECE` bytes at a time (a small transient, not a block-sized one), the first
    before the range and the last after it (the file stays read in order).

    Args:
        raw: the item's stream (frame and edge blocks are read from it).
        layout: the item's parsed `zipformat.ChunkLayout`.
        expected: the item's digests (one over the whole item: the range is all its data);
            None: nothing to verify.

    Raises:
        CheckpointCorruptedError: (from `read`) on a damaged block or item, naming its bytes.
    """

    def __init__(
        self,
        raw: Any,
        layout: Any,
        data: torch.Tensor,
        start: int,
        info: _StorageInfo,
        expected: Optional[ItemSum],
        what: str,
    ) -> None:
        self.view = flat_bytes(data)
        self.raw, self.layout, self.info = raw, layout, info
        self.expected, self.what = expected, what
        self.a, self.b = start, start + len(self.view)
        self.done = self.extra_bytes = 0  # leading bytes fed to a whole-item digest; read outside
        self.next = self.end = 0  # blocks [next, end) are still to verify
        self.hasher = new_hasher()  # the whole item's digest, or the first block's
        self.frame_tail = b""
        if expected is not None and not expected.blocked:
            end = layout.data_offset + layout.nbytes
            self.hasher.update(read_exact(raw, 0, layout.data_offset))
            self.frame_tail = read_exact(raw, end, info.length - end)
        elif expected is not None and self.b > start:
            block = expected.block
            self.next, self.end = start // block, -(-self.b // block)
            self._hash_edge(self.hasher, self.next * block, start % block)

    def _hash_edge(self, h: Any, off: int, n: int) -> None:
        """Feeds data bytes `[off, off + n)`, read from `raw`, to `h` a piece at a time."""
        self.raw.seek(self.layout.data_offset + off)
        while n > 0:
            piece = self.raw.read(min(n, _EDGE_PIECE))
            if not piece:
                raise CheckpointCorruptedError(
                    f"{self.what}: {self.info.relative_path} ends inside the item's data region"
                )
            h.update(piece)
            n -= len(piece)
            self.extra_bytes += len(piece)

    def __call__(self, filled: int) -> None:
        expected = self.expected
        if expected is None:
            return
        if not expected.blocked:  # (a restarted read refills bytes already fed)
            self.hasher.update(self.view[self.done : max(self.done, filled)])
            self.done = max(self.done, filled)
            return
        block = expected.block
        while self.next < self.end:
            k = self.next
            lo, hi = k * block, min(expected.data_len, (k + 1) * block)
            if min(hi, self.b) - self.a > filled:
                return
            h = self.hasher if lo < self.a else new_hasher()
            h.update(self.view[max(lo, self.a) - self.a : min(hi, self.b) - self.a])
            if hi > self.b:  # after the range: files stay read in order
                self._hash_edge(h, self.b, hi - self.b)
            if k >= len(expected.blocks) or h.intdigest() != expected.blocks[k]:
                b0 = self.info.offset + expected.data_off + lo
                raise mismatch(self.what, self.info, f"data block {k}, bytes {b0}-{b0 + hi - lo}")
            self.next = k + 1

    def read(self, path: str, offset: int, request: int) -> None:
        """Reads the range from `offset` of `path`, `request` bytes at a time, and verifies it."""
        read_region(path, offset, self.view, self if self.expected is not None else None, request)
        self(len(self.view))  # what is left (all of it, if the read reported no progress)
        if self.expected is not None and not self.expected.blocked:
            self.hasher.update(self.frame_tail)
            if self.hasher.intdigest() != self.expected.digest:
                raise mismatch(self.what, self.info)
