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
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from .buffers import ALIGN, CHUNK, ChunkBuffers
from .direct import FileWriter, PathLike

__all__ = ["write_segments"]


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


def _stream(out: FileWriter, segments: Sequence[np.ndarray]) -> None:
    """Streams segments through two aligned chunk buffers (copy overlaps the write)."""
    bufs = ChunkBuffers.acquire()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dc-seg-io")
    pending: Optional[Future] = None
    which, fill, file_pos = 0, 0, 0
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
