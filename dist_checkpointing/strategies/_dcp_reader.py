"""Reading byte regions of data files at the disk's speed: O_DIRECT with a buffered fallback.

`read_region` fills a destination with the bytes of a file region in large requests: with
O_DIRECT (aligned requests into reusable aligned bounce buffers, or straight into the
destination when it is aligned), else with plain `preadv` straight into the destination.
Memory used beyond the destination: one bounce buffer (`BOUNCE` bytes) per reading thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import CheckpointCorruptedError

__all__ = ["read_region", "advise_huge_pages", "BOUNCE"]

logger = logging.getLogger(__name__)

ALIGN = 4096
BOUNCE = 32 << 20

_no_direct: Dict[str, str] = {}
_lock = threading.Lock()
_free: List[np.ndarray] = []


_HUGE = 2 << 20
_libc: Optional[Any] = None


def _madvise() -> Optional[Any]:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def advise_huge_pages(out: np.ndarray) -> None:
    """Asks for transparent huge pages on the 2 MiB pages lying wholly inside `out`.

    A read into fresh memory (a destination allocated for the load) otherwise takes one page
    fault per 4 KiB page, which on the VMs we measured cost more CPU than the copy itself;
    with huge pages it takes one per 2 MiB. Memory already populated is left as it is. Only
    for memory that is about to be overwritten whole; best effort (ignored where unsupported).
    """
    madvise = _madvise()
    if madvise is None or out.size < 2 * _HUGE:
        return
    start = -(-out.ctypes.data // _HUGE) * _HUGE
    end = (out.ctypes.data + out.size) // _HUGE * _HUGE
    if end > start:
        madvise(start, end - start, getattr(mmap, "MADV_HUGEPAGE", 14))


def _bounce() -> np.ndarray:
    with _lock:
        if _free:
            return _free.pop()
    return np.frombuffer(mmap.mmap(-1, BOUNCE), dtype=np.uint8)


def _give_back(buf: np.ndarray) -> None:
    with _lock:
        if len(_free) < 8:
            _free.append(buf)


def _disable(directory: str, e: BaseException) -> None:
    with _lock:
        if directory not in _no_direct:
            _no_direct[directory] = str(e)
            logger.info(
                "O_DIRECT reads are not usable in %s (%s): using buffered reads", directory, e
            )


def _buffered(fd: int, offset: int, out: np.ndarray, path: str) -> None:
    """Reads `out.size` bytes at `offset` straight into `out`, in `BOUNCE`-sized requests."""
    done, n = 0, out.size
    view = memoryview(out)  # type: ignore[arg-type]
    while done < n:
        got = os.preadv(fd, [view[done : min(n, done + BOUNCE)]], offset + done)
        if got <= 0:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + done}")
        done += got


def _direct(fd: int, offset: int, out: np.ndarray, path: str) -> None:
    n = out.size
    end = offset + n
    pos = offset - offset % ALIGN
    done = 0
    # an aligned destination takes the aligned middle part directly
    if offset % ALIGN == 0 and out.ctypes.data % ALIGN == 0 and n >= ALIGN:
        done = n - n % ALIGN
        _buffered(fd, offset, out[:done], path)  # aligned on both sides: same loop
        pos = offset + done
    if done == n:
        return
    bounce = _bounce()
    try:
        while done < n:
            want = min(BOUNCE, -(-(end - pos) // ALIGN) * ALIGN)
            got = os.preadv(fd, [memoryview(bounce[:want])], pos)  # type: ignore[arg-type]
            start = offset + done
            stop = min(pos + got, end)
            if stop <= start or (got < want and stop < end):  # end of file before the region's end
                raise CheckpointCorruptedError(
                    f"{path}: short read at offset {max(start, pos + got)}"
                )
            out[done : done + stop - start] = bounce[start - pos : stop - pos]
            done += stop - start
            pos += want
    finally:
        _give_back(bounce)


def read_region(path: str, offset: int, out: np.ndarray, direct: bool = True) -> None:
    """Reads `out.size` bytes of `path` from `offset` into `out` (flat uint8, C-contiguous).

    Raises:
        CheckpointCorruptedError: the file is shorter than the region, or cannot be read.
    """
    if out.size == 0:
        return
    advise_huge_pages(out)
    directory = os.path.dirname(path)
    use_direct = direct and hasattr(os, "O_DIRECT") and directory not in _no_direct
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if use_direct else 0))
    except OSError as e:
        if not use_direct or e.errno != errno.EINVAL:
            raise CheckpointCorruptedError(f"{path}: cannot be opened ({e})") from e
        _disable(directory, e)
        use_direct = False
        fd = os.open(path, os.O_RDONLY)
    try:
        if use_direct:
            try:
                _direct(fd, offset, out, path)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _disable(directory, e)
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
        _buffered(fd, offset, out, path)
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: read failed at offset {offset} ({e})") from e
    finally:
        os.close(fd)
