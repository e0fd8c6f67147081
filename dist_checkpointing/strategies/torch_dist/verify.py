"""Verifying stored chunks as their bytes are read (no second pass): an item's `ItemSum`
(`integrity`) is one digest of the whole item, or a digest of its frame (the zip records)
plus one per `block` bytes of its data (`ChunkVerifier`)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CheckpointCorruptedError
from ...integrity import ItemSum, new_hasher
from ...storage import read_region

__all__ = ["ChunkVerifier", "check_layout", "flat_bytes", "frame_matches", "mismatch", "read_exact"]


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


def _frame(raw: Any, layout: Any, length: int) -> Tuple[bytes, bytes]:
    """The item's bytes before and after its data (its zip records)."""
    end = layout.data_offset + layout.nbytes
    return read_exact(raw, 0, layout.data_offset), read_exact(raw, end, length - end)


def frame_matches(raw: Any, layout: Any, length: int, expected: ItemSum) -> bool:
    """Whether the item's zip records (all bytes around the data) match their digest."""
    if layout.data_offset != expected.data_off or layout.nbytes != expected.data_len:
        return False
    head, tail = _frame(raw, layout, length)
    h = new_hasher()
    h.update(head)
    h.update(tail)
    return h.intdigest() == expected.digest


def flat_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes as a flat uint8 numpy view (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


class ChunkVerifier:
    """Reads bytes `[start, start + len(data))` of a chunk's data region into `data` (`read`),
    verifying them as they land: called with the leading bytes filled so far, it checks each
    completed block (or feeds a whole-item digest) while still in the CPU caches. The edge
    blocks' bytes outside the range are read from `raw`, the first before it and the last
    after it (the file stays read in order).

    Args:
        raw: the item's stream (frame and edge blocks are read from it).
        layout: the item's parsed `zipformat.ChunkLayout`.
        expected: the item's digests; None: nothing to verify (progress still passed on).
        consume: called with the number of leading bytes verified so far.

    Raises:
        CheckpointCorruptedError: (when called) on a damaged block or item, naming its bytes.
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
        consume: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.view = flat_bytes(data)
        self.raw, self.layout, self.consume = raw, layout, consume
        self.a, self.b = start, start + len(self.view)
        self.info, self.expected, self.what = info, expected, what
        self.done = 0  # leading bytes of `data` verified
        self.hasher: Any = None
        self.frame_tail = self.head = self.tail = b""
        self.next = self.end = self.tail_len = 0  # blocks [next, end) are still to verify
        if expected is not None and not expected.blocked:
            head, self.frame_tail = _frame(raw, layout, info.length)
            self.hasher = new_hasher()
            self.hasher.update(head)
        elif expected is not None and self.b > start:
            block = expected.block
            self.next, self.end = start // block, -(-self.b // block)
            if start % block:
                self.head = self._edge(self.next * block, start % block)
            self.tail_len = max(0, min(expected.data_len, self.end * block) - self.b)

    @property
    def extra_bytes(self) -> int:
        """Bytes read outside the range, to complete its first and last blocks."""
        return len(self.head) + len(self.tail)

    def _edge(self, off: int, n: int) -> bytes:
        got = read_exact(self.raw, self.layout.data_offset + off, n)
        if len(got) != n:
            raise CheckpointCorruptedError(
                f"{self.what}: {self.info.relative_path} ends inside the item's data region"
            )
        return got

    def __call__(self, filled: int) -> None:
        if filled <= self.done:
            return  # (a restarted read refills bytes already verified)
        if self.expected is None:
            self.done = filled
        elif self.hasher is not None:
            self.hasher.update(self.view[self.done : filled])
            self.done = filled
        else:
            self._blocks(self.expected, filled)
        if self.consume is not None:
            self.consume(self.done)

    def _blocks(self, expected: ItemSum, filled: int) -> None:
        block = expected.block
        while self.next < self.end:
            k = self.next
            lo, hi = k * block, min(expected.data_len, (k + 1) * block)
            if min(hi, self.b) - self.a > filled:
                return
            h = new_hasher()
            if lo < self.a:
                h.update(self.head)
            h.update(self.view[max(lo, self.a) - self.a : min(hi, self.b) - self.a])
            if hi > self.b:
                if not self.tail and self.tail_len:  # after the range: files stay read in order
                    self.tail = self._edge(self.b, self.tail_len)
                h.update(self.tail)
            if k >= len(expected.blocks) or h.intdigest() != expected.blocks[k]:
                b0 = self.info.offset + expected.data_off + lo
                raise mismatch(self.what, self.info, f"data block {k}, bytes {b0}-{b0 + hi - lo}")
            self.next, self.done = k + 1, min(hi, self.b) - self.a

    def read(self, path: str, offset: int, request: int) -> None:
        """Reads the range from `offset` of `path`, `request` bytes at a time, and verifies it."""
        needed = self.expected is not None or self.consume is not None
        read_region(path, offset, self.view, self if needed else None, request)
        self.finish()

    def finish(self) -> None:
        """Verifies (and consumes) what is left (all of it, if the read reported no progress)."""
        self(len(self.view))
        if self.hasher is not None:
            self.hasher.update(self.frame_tail)
            if self.hasher.intdigest() != self.expected.digest:  # type: ignore[union-attr]
                raise mismatch(self.what, self.info)
