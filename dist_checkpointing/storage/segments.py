"""Writing a file given as a sequence of byte segments (its concatenation), at disk speed.

Used by local checkpoint images, whose file is either one staged host buffer or, for a
synchronous save of CPU tensors, the tensors' own memory interleaved with small padding
and header segments (no full copy of the state is made).

- With O_DIRECT (`direct=True`, where the file system allows it): segments that are one
  page-aligned buffer are written as they are; anything else streams through the pooled
  pair of aligned chunk buffers (`ChunkBuffers`), the copy of one chunk overlapping the
  write of the other, as the torch_dist backend's synchronous save does.
- Buffered (`direct=False`, or O_DIRECT refused): each segment is written from its own
  memory (the kernel's page-cache copy is the only copy).
- `fsync` decides whether the file is made durable before returning.

`StreamedFile` is the other way in: a new file filled by positional writes of chunks as they
arrive (a replica received over the network is written chunk by chunk, never held whole).
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .buffers import ALIGN, CHUNK, ChunkBuffers
from .direct import FileWriter, PathLike

__all__ = ["ChunkStream", "StreamedFile", "write_segments"]


def _aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0


def write_segments(
    path: PathLike,
    segments: Sequence[np.ndarray],
    *,
    direct: bool,
    fsync: bool,
    exclusive: bool = True,
    overwrite: bool = False,
    padded: Optional[np.ndarray] = None,
    prepare: Optional[Callable[[int], Optional[Callable[[np.ndarray], None]]]] = None,
) -> int:
    """Writes the concatenation of `segments` (flat uint8 arrays) to a new file.

    Args:
        path: the file (created; with `exclusive`, FileExistsError if it exists).
        segments: the file's bytes, in order.
        direct: try O_DIRECT (falls back to buffered writes where refused).
        fsync: make the file durable before returning.
        exclusive: refuse an existing file.
        overwrite: write over the existing file `path` in place (its blocks reused, no
            truncation before; truncated to the written size at the end).
        padded: when `segments` is a single buffer, the same buffer extended to a multiple
            of `ALIGN` with zeros (page-aligned memory): written directly with O_DIRECT
            (not with `prepare`).
        prepare: called with a segment's index just before the segment is written (so it
            may still fill a later segment's bytes); may return a callback that sees each
            piece of that segment as it is written (e.g. to checksum it while the bytes are
            in the CPU caches: no separate pass).

    Returns:
        The number of bytes written.

    Raises:
        OSError: the write failed (the partial file is removed).
    """
    size = int(sum(s.size for s in segments))
    out = FileWriter(
        path, size, direct=direct, exclusive=exclusive, preallocate=direct, overwrite=overwrite
    )
    try:
        if (
            out.direct
            and prepare is None
            and padded is not None
            and _aligned(padded)
            and padded.size % ALIGN == 0
        ):
            view = memoryview(padded)  # type: ignore[arg-type]
            for start in range(0, padded.size, CHUNK):
                out.write(view[start : start + CHUNK], start)
        elif out.direct:
            _stream(out, segments, prepare=prepare)
        else:
            pos = 0
            for i, seg in enumerate(segments):
                seen = prepare(i) if prepare is not None else None
                view = memoryview(seg)  # type: ignore[arg-type]
                for start in range(0, seg.size, CHUNK):
                    out.write(view[start : start + CHUNK], pos + start)
                    if seen is not None:
                        seen(seg[start : start + CHUNK])
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


class ChunkStream:
    """Appends bytes to a file through two aligned chunk buffers: filling one overlaps the
    write of the other (one writer thread). `finish()` writes the padded tail and waits;
    `close()` (always, in a `finally`) waits for a write in flight and frees the buffers.

    Args:
        out: the file being written.
        file_pos: where the first byte goes (aligned).
        pin: page-lock the buffers (device tensors are copied into them).
        progress: called with the bytes of each chunk handed to the disk.
    """

    def __init__(
        self,
        out: FileWriter,
        file_pos: int = 0,
        pin: bool = False,
        progress: Optional[Callable[[int], None]] = None,
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
        n = -(-fill // ALIGN) * ALIGN if final else fill
        buf = self._bufs[self._which]
        if n > fill:
            buf[fill:n] = 0
        if self._pending is not None:
            self._pending.result()  # the write that used the buffer we switch to next
        self._pending = self._pool.submit(self._write, memoryview(buf[:n]), self._pos)  # type: ignore[arg-type]
        if self._progress is not None:
            self._progress(fill)
        self._pos += fill
        self._which, self._fill = 1 - self._which, 0

    def _write(self, view: memoryview, pos: int) -> None:
        self._out.write(view, pos)

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
        """Waits for a write in flight (its error was or will be raised elsewhere) and frees
        the buffers."""
        if self._pending is not None:
            self._pending.exception()
        self._pool.shutdown(wait=True)
        ChunkBuffers.release(self._bufs)


def _stream(
    out: FileWriter,
    segments: Sequence[np.ndarray],
    file_pos: int = 0,
    prepare: Optional[Callable[[int], Optional[Callable[[np.ndarray], None]]]] = None,
) -> None:
    """Streams segments through `ChunkStream`, from `file_pos` (aligned) on (`prepare`: as
    in `write_segments`)."""
    stream = ChunkStream(out, file_pos)
    try:
        for i, seg in enumerate(segments):
            stream.put(seg, prepare(i) if prepare is not None else None)
        stream.finish()
    finally:
        stream.close()


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
        overwrite: write over the existing file `path` in place (see `FileWriter`).

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
        overwrite: bool = False,
    ) -> None:
        self.size, self.fsync = size, fsync
        self._out = FileWriter(
            path, size, direct=direct, exclusive=exclusive, preallocate=direct, overwrite=overwrite
        )
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
