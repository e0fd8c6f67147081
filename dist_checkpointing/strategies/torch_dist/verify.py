"""Verifying stored chunks against `checksums.json` as their bytes are read (no second pass).

An item's `ItemSum` (see `integrity`) is one digest of the whole item, or a digest of its
frame (the zip records) plus one per `block` bytes of its data. `ChunkVerifier` checks a
region starting on a block boundary; `RangeVerifier` one with arbitrary ends, reading the
bytes of its partial edge blocks that lie outside it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CheckpointCorruptedError
from ...integrity import ItemSum, new_hasher

__all__ = [
    "ChunkVerifier",
    "check_layout",
    "block_mismatch",
    "RangeVerifier",
    "Verifier",
    "flat_bytes",
    "frame",
    "frame_matches",
    "mismatch",
    "read_exact",
]


def mismatch(what: str, info: _StorageInfo) -> CheckpointCorruptedError:
    """The error for an item whose bytes do not match their digest."""
    return CheckpointCorruptedError(
        f"{what}: checksum mismatch in bytes {info.offset}-{info.offset + info.length} of "
        f"{info.relative_path}: the stored data is damaged"
    )


def block_mismatch(what: str, info: _StorageInfo, expected: ItemSum, k: int) -> Exception:
    """The error for block `k` of an item's data region not matching its digest."""
    b0 = info.offset + expected.data_off + k * expected.block
    b1 = info.offset + expected.data_off + min(expected.data_len, (k + 1) * expected.block)
    return CheckpointCorruptedError(
        f"{what}: checksum mismatch in data block {k}, bytes {b0}-{b1} of "
        f"{info.relative_path}: the stored data is damaged"
    )


def check_layout(
    layout: Any, stored: Optional[Tuple[Tuple[int, ...], torch.dtype]], what: str
) -> None:
    """Raises `CheckpointCorruptedError` where a chunk's zip records (`layout`) say another
    shape or dtype than the metadata does (`stored`; None: not recorded): a damaged record."""
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


def frame(raw: Any, layout: Any, length: int) -> Tuple[bytes, bytes]:
    """The item's bytes before and after its data (its zip records)."""
    end = layout.data_offset + layout.nbytes
    return read_exact(raw, 0, layout.data_offset), read_exact(raw, end, length - end)


def frame_matches(raw: Any, layout: Any, length: int, expected: ItemSum) -> bool:
    """Whether the item's zip records (all bytes around the data) match their digest."""
    if layout.data_offset != expected.data_off or layout.nbytes != expected.data_len:
        return False
    head, tail = frame(raw, layout, length)
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
    """Verifies a chunk's data as `read_region` fills it.

    Called with the leading bytes of `data` (from `start`, a block boundary) filled so far;
    hashes each completed block while it is still in the CPU caches (whole-item digests are
    fed incrementally). `finish` completes the check.

    Args:
        raw: the item's stream (the frame of whole-item digests is read from it).
        data: the bytes being filled, from `start` in the item's data region.
        expected: the item's digests; None: nothing to verify (progress still passed on).
        consume: called with the number of leading bytes verified so far.
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
        self.consume = consume
        self.start, self.info, self.expected, self.what = start, info, expected, what
        self.done = 0
        self.hasher: Any = None
        self.tail = b""
        if expected is not None and not expected.blocked:
            head, self.tail = frame(raw, layout, info.length)
            self.hasher = new_hasher()
            self.hasher.update(head)

    @property
    def needed(self) -> bool:
        """Whether the read must report its progress to this verifier."""
        return self.expected is not None or self.consume is not None

    #: bytes read beyond `data` to verify it (none: `data` starts on a block boundary)
    extra_bytes = 0

    def __call__(self, filled: int) -> None:
        expected = self.expected
        if filled <= self.done:
            return  # (a restarted read refills bytes already verified)
        if expected is None:
            self.done = filled
        elif self.hasher is not None:
            self.hasher.update(self.view[self.done : filled])
            self.done = filled
        else:
            self._blocks(expected, filled)
        if self.consume is not None:
            self.consume(self.done)

    def _blocks(self, expected: ItemSum, filled: int) -> None:
        upto = filled if filled >= len(self.view) else filled - filled % expected.block
        if upto <= self.done:
            return
        bad = expected.bad_block(self.view[self.done : upto], self.start + self.done)
        if bad is not None:
            raise block_mismatch(self.what, self.info, expected, bad)
        self.done = upto

    def finish(self) -> None:
        """Verifies (and consumes) what is left (all of it, if the read reported no progress)."""
        self(len(self.view))
        if self.expected is None:
            return
        if self.hasher is not None:
            self.hasher.update(self.tail)
            if self.hasher.intdigest() != self.expected.digest:
                raise mismatch(self.what, self.info)


class RangeVerifier:
    """Verifies the blocks that a range `[a, b)` of a blocked item's data region touches, as
    the range is read straight into its destination.

    The bytes of its first and last blocks outside the range (rows of a resharded load) are
    read here (the first before the range, the last after it).

    Args:
        read_edge: reads `n` data-region bytes from data offset `off`.
        data: the destination being filled with the range's bytes.
        expected: the item's digests (blocked).

    Raises:
        CheckpointCorruptedError: (when called) on a damaged block, naming its bytes.
    """

    #: the read always reports its progress here (every block is checked)
    needed = True

    def __init__(
        self,
        read_edge: Callable[[int, int], bytes],
        data: torch.Tensor,
        a: int,
        info: _StorageInfo,
        expected: ItemSum,
        what: str,
    ) -> None:
        self.view = flat_bytes(data)
        self.a, self.b = a, a + len(self.view)
        self.info, self.expected, self.what = info, expected, what
        block = expected.block
        self.first = a // block
        self.end = -(-self.b // block) if self.b > a else self.first  # blocks [first, end)
        self.next = self.first
        self.read_edge = read_edge
        self.head, self.tail, self.tail_len = b"", b"", 0
        if self.end == self.first:  # an empty range touches no block
            return
        if a % block:
            self.head = self._edge(self.first * block, a - self.first * block)
        self.tail_len = max(0, min(expected.data_len, self.end * block) - self.b)

    def _edge(self, off: int, n: int) -> bytes:
        got = self.read_edge(off, n)
        if len(got) != n:
            raise CheckpointCorruptedError(
                f"{self.what}: {self.info.relative_path} ends inside the item's data region"
            )
        return got

    @property
    def extra_bytes(self) -> int:
        """Bytes read outside the range, to complete its first and last blocks."""
        return len(self.head) + len(self.tail)

    def _pieces(self, k: int) -> List[Any]:
        block = self.expected.block
        lo, hi = k * block, min(self.expected.data_len, (k + 1) * block)
        parts: List[Any] = []
        if lo < self.a:
            parts.append(self.head)
        parts.append(self.view[max(lo, self.a) - self.a : min(hi, self.b) - self.a])
        if hi > self.b:
            if not self.tail and self.tail_len:  # after the range: files stay read in order
                self.tail = self._edge(self.b, self.tail_len)
            parts.append(self.tail)
        return parts

    def __call__(self, filled: int) -> None:
        block = self.expected.block
        while self.next < self.end:
            k = self.next
            hi = min(self.expected.data_len, (k + 1) * block)
            if min(hi, self.b) - self.a > filled:
                return
            h = new_hasher()
            for part in self._pieces(k):
                h.update(part)
            if k >= len(self.expected.blocks) or h.intdigest() != self.expected.blocks[k]:
                raise block_mismatch(self.what, self.info, self.expected, k)
            self.next = k + 1

    def finish(self) -> None:
        """Verifies every block not verified yet (all of them, if no progress was reported)."""
        self(len(self.view))


#: what a read reports its progress to
Verifier = Union[ChunkVerifier, RangeVerifier]
