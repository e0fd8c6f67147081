"""Writing a file given as a sequence of byte segments (its concatenation), at disk speed.

Used by local checkpoint images, whose file is either one staged host buffer or, for a
synchronous save of CPU tensors, the tensors' own memory interleaved with small padding
and header segments (no full copy of the state is made).

- With O_DIRECT (`direct=True`, where the file system allows it): segments that are one
  page-aligned buffer are written as they are; anything else streams through the pooled
  pair of aligned chunk buffers (`ChunkBuffers`), the copy of one chunk overlapping the
  write of the other, as the torch_dist backend's synchronous save does.
- Buffered (`direct=False`): each segment is written from its own memory (the kernel's
  page-cache copy is the only copy).
- `fsync` decides whether the file is made durable before returning.

`StreamedFile` is the other way in: a new file filled by positional writes of chunks as they
arrive (a replica received over the network is written chunk by chunk, never held whole).
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from .buffers import ALIGN, CHUNK, ChunkBuffers
from .direct import FileWriter, PathLike

__all__ = ["StreamedFile", "write_segments"]


def _aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0


def write_segments(
    path: PathLike,
    segments: Sequence[np.ndarray],
    *,
    direct: bool,
    fsync: bool,
    exclusive: bool = True,
    padded: Optional[np.ndarray] = None,
) -> int:
    """Writes the concatenation of `segments` (flat uint8 arrays) to a new file.

    Args:
        path: the file (created; with `exclusive`, FileExistsError if it exists).
        segments: the file's bytes, in order.
        direct: try O_DIRECT (falls back to buffered writes where refused).
        fsync: make the file durable before returning.
        exclusive: refuse an existing file.
        padded: when `segments` is a single buffer, the same buffer extended to a multiple
            of `ALIGN` with zeros (page-aligned memory): written directly with O_DIRECT.

    Returns:
        The number of bytes written.

    Raises:
        OSError: the write failed (the partial file is removed).
    """
    size = int(sum(s.size for s in segments))
    out = FileWriter(path, size, direct=direct, exclusive=exclusive, preallocate=direct)
    try:
        if out.direct and padded is not None and _aligned(padded) and padded.size % ALIGN == 0:
            view = memoryview(padded)  # type: ignore[arg-type]
            for start in range(0, padded.size, CHUNK):
                out.write(view[start : start + CHUNK], start)
        elif out.direct:
            _stream(out, segments)
        else:
            pos = 0
            for seg in segments:
                view = memoryview(seg)  # type: ignore[arg-type]
                for start in range(0, seg.size, CHUNK):
                    out.write(view[start : start + CHUNK], pos + start)
                pos += seg.size
        if fsync:
            out.finish()
        else:
            os.ftruncate(out.fd, size)
            out.abort()  # closes without fsync
    except BaseException:
        out.abort(remove=True)
        raise
    return size


def _stream(out: FileWriter, segments: Sequence[np.ndarray], file_pos: int = 0) -> None:
    """Streams segments through two aligned chunk buffers (copy overlaps the write), from
    `file_pos` (aligned) on."""
    bufs = ChunkBuffers.acquire()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dc-seg-io")
    pending: Optional[Future] = None
    which, fill = 0, 0
    try:

        def flush(final: bool) -> None:
            nonlocal which, fill, file_pos, pending
            if fill == 0:
                return
            n = -(-fill // ALIGN) * ALIGN if final else fill
            buf = bufs[which]
            if n > fill:
                buf[fill:n] = 0
            if pending is not None:
                pending.result()
            pending = pool.submit(out.write, memoryview(buf[:n]), file_pos)  # type: ignore[arg-type]
            file_pos += fill
            which, fill = 1 - which, 0

        for seg in segments:
            pos = 0
            while pos < seg.size:
                if fill == CHUNK:
                    flush(False)
                n = min(CHUNK - fill, seg.size - pos)
                bufs[which][fill : fill + n] = seg[pos : pos + n]
                fill += n
                pos += n
        flush(True)
        if pending is not None:
            pending.result()
    finally:
        if pending is not None:
            pending.exception()
        pool.shutdown(wait=True)
        ChunkBuffers.release(bufs)


class StreamedFile:
    """A new file of known size, written front to back in chunks of any size as they arrive.

    With `direct` (where the file system allows O_DIRECT), the page-aligned middle of each
    chunk is written straight from the caller's memory when that memory is placed so that
    its address and its file offset agree modulo `ALIGN` (see `placement`); the partial
    pages at chunk borders are assembled in one aligned page and written when complete.
    Nothing is copied into the page cache: for data this machine will probably never read
    back (a replica of another machine's part). Otherwise writes are buffered. `close` makes
    the file durable when `fsync`.

    Args:
        path: the file (created; with `exclusive`, FileExistsError if it exists).
        size: its final size (every byte of `[0, size)` is written, in order, before `close`).
        fsync: fsync the file in `close`.
        direct: try O_DIRECT.
        exclusive: refuse an existing file.

    Raises:
        FileExistsError: `path` exists and `exclusive`.
        OSError: the file cannot be created.
    """

    def __init__(
        self,
        path: PathLike,
        size: int,
        *,
        fsync: bool,
        direct: bool = False,
        exclusive: bool = True,
    ) -> None:
        self.size, self.fsync = size, fsync
        self._out = FileWriter(path, size, direct=direct, exclusive=exclusive, preallocate=direct)
        self._pos = 0  # bytes written so far (the next chunk's offset)
        self._held = 0  # bytes of the partial page at the end of the file held in `_page`
        self._page = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8) if direct else None

    @staticmethod
    def placement(offset: int) -> int:
        """Where in an aligned buffer to place a chunk for `offset` (zero-copy with O_DIRECT)."""
        return offset % ALIGN

    def write(self, data: np.ndarray, offset: int) -> None:
        """Writes `data` (flat uint8) at `offset`, which must follow the previous chunk.

        Raises:
            OSError: the write failed.
            ValueError: `offset` is not where the previous chunk ended.
        """
        if offset != self._pos:
            raise ValueError(f"{self._out.path}: chunk at {offset}, expected {self._pos}")
        n = int(data.size)
        if not n:
            return
        self._pos += n
        page = self._page
        if page is not None and self._out.direct:
            lead = self._held  # == offset % ALIGN: the partial page's first bytes
            head = min(n, (ALIGN - lead) % ALIGN)
            if head:
                page[lead : lead + head] = data[:head]
                self._held = lead + head
                if self._held < ALIGN:
                    return
                self._out.write(memoryview(page), offset - lead)  # type: ignore[arg-type]
                self._held = 0
            middle = (n - head) // ALIGN * ALIGN
            if middle:
                body = data[head : head + middle]
                if body.ctypes.data % ALIGN:  # misplaced in memory: through aligned chunks
                    _stream(self._out, [body], offset + head)
                else:
                    self._out.write(memoryview(body), offset + head)  # type: ignore[arg-type]
            data, offset = data[head + middle :], offset + head + middle
            if self._out.direct:
                page[: data.size] = data  # the next partial page, completed later
                self._held = int(data.size)
                return
        if self._held:  # O_DIRECT was refused part-way: the held bytes go out buffered
            assert page is not None
            self._out.write(memoryview(page[: self._held]), offset - self._held)  # type: ignore[arg-type]
            self._held = 0
        if data.size:
            self._out.write(memoryview(data), offset)  # type: ignore[arg-type]

    def close(self) -> None:
        """Writes the last partial page, sets the final size, fsyncs when asked, closes.

        Raises:
            OSError: a write, truncation or fsync failed (the caller removes the file).
        """
        try:
            if self._held:
                assert self._page is not None
                if self._out.direct:
                    self._page[self._held :] = 0  # padding, truncated below
                    view = self._page
                else:
                    view = self._page[: self._held]
                self._out.write(memoryview(view), self._pos - self._held)  # type: ignore[arg-type]
                self._held = 0
            if self.fsync:
                self._out.finish()
                return
            os.ftruncate(self._out.fd, self.size)
        except BaseException:
            self._out.abort()
            raise
        self._out.abort()  # closes without fsync

    def abort(self) -> None:
        """Closes and removes the file (after a failure)."""
        self._out.abort(remove=True)
