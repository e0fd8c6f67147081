"""Files written from byte segments (local checkpoint images) or from chunks as they arrive
(`StreamedFile`: a replica received over the network). With O_DIRECT a page-aligned buffer
is written as it is and anything else streams through a pooled pair of aligned chunk
buffers (`ChunkStream`); buffered, each segment is written from its own memory."""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .buffers import ALIGN, CHUNK, ChunkBuffers, aligned
from .direct import FileWriter, PathLike, Progress

__all__ = ["ChunkStream", "StreamedFile", "write_chunks", "write_segments"]


def write_chunks(out: Any, buf: np.ndarray, pos: int) -> None:
    """Writes `buf` (flat uint8) at `pos` of `out` (a `FileWriter`), `CHUNK` bytes a request."""
    view = memoryview(buf)  # type: ignore[arg-type]
    for start in range(0, buf.size, CHUNK):
        out.write(view[start : start + CHUNK], pos + start)


def write_segments(
    path: PathLike,
    segments: Sequence[np.ndarray],
    *,
    direct: bool,
    fsync: bool,
    overwrite: bool = False,
    padded: Optional[np.ndarray] = None,
) -> int:
    """Writes `segments` (flat uint8 arrays), concatenated, to a new file (with O_DIRECT if
    `direct` and allowed; durable before returning if `fsync`); returns its size.

    Args:
        overwrite: write over an existing file in place (else it must not exist).
        padded: for a single segment, the same page-aligned buffer zero-padded to a multiple
            of `ALIGN`: written directly with O_DIRECT.

    Raises:
        OSError: the write failed (the partial file is removed).
    """
    size = int(sum(s.size for s in segments))
    in_pages = padded is not None and padded.ctypes.data % ALIGN == 0 and padded.size % ALIGN == 0
    out = FileWriter(
        path, size, direct=direct, exclusive=True, preallocate=direct, overwrite=overwrite
    )
    try:
        if out.direct and in_pages:
            assert padded is not None
            write_chunks(out, padded, 0)
        elif out.direct:
            _stream(out, segments)
        else:
            pos = 0
            for seg in segments:
                write_chunks(out, seg, pos)
                pos += seg.size
        out.finish(fsync)
    except BaseException:
        out.abort(remove=True)
        raise
    return size


class ChunkStream:
    """Appends bytes to a file through two aligned chunk buffers, filling one while the
    other is written. `finish()` writes the padded tail; `close()` (always) frees them.

    Args:
        file_pos: where the first byte goes in `out` (aligned).
        pin: page-lock the buffers (for copies from device tensors).
        progress: called with the bytes of each chunk handed to the disk.
    """

    def __init__(
        self, out: FileWriter, file_pos: int = 0, pin: bool = False, progress: Progress = None
    ) -> None:
        self._out, self._pos, self._progress = out, file_pos, progress
        self._bufs = ChunkBuffers.acquire(pin=pin)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dc-chunk-io")
        self._pending: Optional[Future] = None
        self._which, self._fill = 0, 0

    def _flush(self, final: bool) -> None:
        fill = self._fill
        if fill == 0:
            return
        n = aligned(fill) if final else fill
        buf = self._bufs[self._which]
        if n > fill:
            buf[fill:n] = 0
        if self._pending is not None:
            self._pending.result()  # the write that used the buffer we switch to next
        view = memoryview(buf[:n])  # type: ignore[arg-type]
        self._pending = self._pool.submit(self._out.write, view, self._pos)
        if self._progress is not None:
            self._progress(fill)
        self._pos += fill
        self._which, self._fill = 1 - self._which, 0

    def put(self, data: Any, on_copied: Optional[Callable[[np.ndarray], None]] = None) -> None:
        """Appends `data` (a uint8 array, or a device tensor's uint8 bytes); `on_copied`
        sees each piece as it lands in a buffer (e.g. to checksum it)."""
        is_tensor = isinstance(data, torch.Tensor)
        pos, size = 0, int(data.numel() if is_tensor else data.size)
        while pos < size:
            if self._fill == CHUNK:
                self._flush(False)
            n = min(CHUNK - self._fill, size - pos)
            dst = self._bufs[self._which][self._fill : self._fill + n]
            if is_tensor:
                torch.from_numpy(dst).copy_(data[pos : pos + n])
            else:
                dst[:] = data[pos : pos + n]
            if on_copied is not None:
                on_copied(dst)
            self._fill += n
            pos += n

    def finish(self) -> None:
        """Writes the last (zero-padded) chunk and waits for every write."""
        self._flush(True)
        if self._pending is not None:
            self._pending.result()

    def close(self) -> None:
        """Waits for any write in flight (its error is raised elsewhere); frees the buffers."""
        if self._pending is not None:
            self._pending.exception()
        self._pool.shutdown(wait=True)
        ChunkBuffers.release(self._bufs)


def _stream(out: FileWriter, segments: Sequence[np.ndarray], file_pos: int = 0) -> None:
    """Streams `segments` through a `ChunkStream` from `file_pos` (aligned)."""
    stream = ChunkStream(out, file_pos)
    try:
        for seg in segments:
            stream.put(seg)
        stream.finish()
    finally:
        stream.close()


class StreamedFile:
    """A new file of known size, written front to back in chunks of any size as they arrive.

    With `direct`, the page-aligned middle of each chunk is written from the caller's
    memory (through aligned chunks where it is not aligned there), partial pages at chunk
    borders are assembled in one aligned page, and nothing enters the page cache (a replica
    is rarely read back here). Otherwise writes are buffered.

    Args:
        size: the final size (every byte of `[0, size)` is written, in order, before `close`).
        overwrite: write over an existing file in place (else it must not exist).

    Raises:
        OSError: the file cannot be created (FileExistsError: it exists, not `overwrite`).
    """

    def __init__(
        self,
        path: PathLike,
        size: int,
        *,
        fsync: bool,
        direct: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.size, self.fsync = size, fsync
        self._out = FileWriter(
            path, size, direct=direct, exclusive=True, preallocate=direct, overwrite=overwrite
        )
        self._pos = 0  # bytes written so far (the next chunk's offset)
        self._held = 0  # bytes of the partial page at the end of the file held in `_page`
        self._page = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8) if direct else None

    def write(self, data: np.ndarray, offset: int) -> None:
        """Writes `data` (flat uint8) at `offset`, which must follow the previous chunk.

        Raises:
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
        """Writes the last partial page, truncates to `size`, fsyncs when asked, closes.

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
            self._out.finish(self.fsync)
        except BaseException:
            self._out.abort()
            raise

    def abort(self) -> None:
        """Closes and removes the file (after a failure)."""
        self._out.abort(remove=True)
