"""Direct I/O (O_DIRECT) with a buffered fallback: positional reads and writes of whole files.

The I/O layer shared by the torch_dist backend and local checkpoints:

- `read_region` fills a destination with the bytes of a file region in large requests,
  several in flight (`inflight`): with O_DIRECT (aligned requests into reusable aligned
  bounce buffers, in huge pages where the kernel gives them, or straight into the
  destination when it is aligned), else with plain
  `preadv` straight into the destination.
  Memory used beyond the destination: one bounce buffer per reading thread (cut into one
  slot per request in flight).
- `FileWriter` writes a file in large positional requests, preallocated, with O_DIRECT where
  the file system supports it (aligned requests, the last padded and the file truncated
  back), fsync'd once when finished.
- `read_file` reads a whole (small or large) file into a new host tensor.

Where a file system refuses O_DIRECT, the directory is remembered in ONE registry
(`direct_allowed` / `refuse_direct`, logged once per directory and direction) and buffered
I/O is used from then on. Every request goes through `faults.check` (the test seam).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from ..errors import CheckpointCorruptedError
from . import buffers, faults
from .buffers import ALIGN
from .inflight import DEPTH, read_in_flight, read_spans_through_slots, read_through_slots

__all__ = [
    "ALIGN",
    "CHUNK_READ",
    "BUFFERED_DEPTH",
    "DirectUnavailable",
    "open_for_reads",
    "read_region",
    "read_spans",
    "read_file",
    "direct_allowed",
    "refuse_direct",
    "reset_direct_fallbacks",
    "pwrite_all",
    "FileWriter",
    "start_writeback",
]

logger = logging.getLogger(__name__)

#: largest single buffered read request
CHUNK_READ = 32 << 20
#: buffered read requests of one region in flight by default: one. The kernel reads ahead of a
#: sequential stream on its own, so the device stays busy while a request's bytes are copied
#: and verified; more requests of one stream in flight break that sequence into competing
#: pieces. Measured on this project's CI VM (cold cache, 1 GiB in 16 chunks per world, one file
#: per process, medians of 5 alternating runs): 2 processes read in 0.60 s with one 16 MiB
#: request in flight, 0.86 s with four 8 MiB ones, 1.17 s with two threads of four each;
#: 4 processes 0.62 s, 0.74 s and 1.13 s (docs/performance.md). O_DIRECT has no readahead
#: and keeps `DEPTH` requests in flight.
BUFFERED_DEPTH = 1
PathLike = Union[str, "os.PathLike[str]"]
#: called with the number of leading bytes of the destination filled so far
Progress = Optional[Callable[[int], None]]

# ---- the O_DIRECT fallback registry ----------------------------------------------------

_refused: Dict[str, str] = {}  # directory -> why O_DIRECT is not used there
_logged: Set[Tuple[str, str]] = set()  # (directory, "reads"/"writes") already logged
_lock = threading.Lock()


def direct_allowed(directory: str) -> bool:
    """Whether O_DIRECT should be tried in `directory` (not refused there before)."""
    return hasattr(os, "O_DIRECT") and directory not in _refused


def refuse_direct(directory: str, e: BaseException, what: str) -> None:
    """Records that O_DIRECT failed in `directory`; later I/O there is buffered (logged once).

    Args:
        directory: the directory (its file system refused O_DIRECT).
        e: the error O_DIRECT gave.
        what: "reads" or "writes", for the log line.
    """
    with _lock:
        _refused.setdefault(directory, str(e))
        if (directory, what) in _logged:
            return
        _logged.add((directory, what))
    if what == "reads":
        logger.info("O_DIRECT reads are not usable in %s (%s): using buffered reads", directory, e)
    else:
        logger.info("O_DIRECT is not usable in %s (%s): using buffered writes", directory, e)


def reset_direct_fallbacks() -> None:
    """Forgets every refusal (tests; a remounted file system)."""
    with _lock:
        _refused.clear()
        _logged.clear()


# ---- reads -------------------------------------------------------------------------------


def _buffered(
    fd: int,
    offset: int,
    out: np.ndarray,
    path: str,
    progress: Progress = None,
    request: int = CHUNK_READ,
    depth: int = 1,
) -> None:
    """Reads `out.size` bytes at `offset` straight into `out`, in `request`-sized requests,
    `depth` of them in flight (`inflight`).

    `progress(filled)` follows the requests, in order.
    """
    read_in_flight(fd, offset, out, path, progress, request, depth)


def _direct(
    fd: int,
    offset: int,
    out: np.ndarray,
    path: str,
    progress: Progress,
    request: int,
    depth: int = 1,
) -> None:
    n = out.size
    end = offset + n
    pos = offset - offset % ALIGN
    done = 0
    # an aligned destination takes the aligned middle part directly
    if offset % ALIGN == 0 and out.ctypes.data % ALIGN == 0 and n >= ALIGN:
        done = n - n % ALIGN
        # aligned on both sides: same loop (the request size stays a multiple of ALIGN)
        step = max(ALIGN, request // ALIGN * ALIGN)
        _buffered(fd, offset, out[:done], path, progress, step, depth)
        pos = offset + done
    if done == n:
        return
    # the rest through one bounce buffer cut into `depth` slots, several requests in flight
    # while the calling thread copies the previous ones out (and `progress` verifies them)
    depth = max(1, min(depth, buffers.BOUNCE // ALIGN))
    step = max(ALIGN, min(buffers.BOUNCE // depth, request) // ALIGN * ALIGN)
    start = offset + done
    pos = start - start % ALIGN
    length = -(-(end - pos) // ALIGN) * ALIGN
    bounce = buffers.bounce()
    view = memoryview(bounce)  # type: ignore[arg-type]
    slots = [view[i * step : (i + 1) * step] for i in range(min(depth, -(-length // step)))]

    def deliver(at: int, data: memoryview) -> None:
        nonlocal done
        lo, hi = max(at, offset + done), min(at + len(data), end)
        if lo != offset + done or hi <= lo:  # the file ends before the region does
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + done}")
        out[done : done + hi - lo] = np.frombuffer(data, dtype=np.uint8)[lo - at : hi - at]
        done += hi - lo
        if progress is not None:
            progress(done)

    try:
        read_through_slots(fd, pos, length, slots, deliver)
        if done < n:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + done}")
    finally:
        buffers.give_back(bounce)


def read_region(
    path: str,
    offset: int,
    out: np.ndarray,
    direct: bool = True,
    progress: Progress = None,
    request: int = CHUNK_READ,
    depth: Optional[int] = None,
) -> None:
    """Reads `out.size` bytes of `path` from `offset` into `out` (flat uint8, C-contiguous).

    Args:
        path: the file.
        offset: where the region starts in it.
        out: the destination.
        direct: read with O_DIRECT where the directory allows it (else through the page cache).
        progress: called after each request with the number of leading bytes of `out` filled
            (increasing, the last call with `out.size`), while those bytes are still in the
            CPU caches: lets a caller verify or consume them without a second pass.
        request: bytes per request (with O_DIRECT: rounded down to `ALIGN`, at most `BOUNCE`).
        depth: requests in flight at once (`inflight.read_in_flight`; into an unaligned
            destination with O_DIRECT, through as many slots of one `BOUNCE` buffer:
            `inflight.read_through_slots`). None: `DEPTH` with O_DIRECT, one through the
            page cache (`BUFFERED_DEPTH`).

    Raises:
        CheckpointCorruptedError: the file is shorter than the region, or cannot be read.
    """
    if out.size == 0:
        return
    faults.check("read", path, offset, out.size, direct)
    directory = os.path.dirname(path)
    fd, use_direct = open_for_reads(path, direct)
    try:
        if use_direct:
            try:
                _direct(fd, offset, out, path, progress, request, depth or DEPTH)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refuse_direct(directory, e, "reads")
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
        _buffered(fd, offset, out, path, progress, request, depth or BUFFERED_DEPTH)
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: read failed at offset {offset} ({e})") from e
    finally:
        os.close(fd)


def open_for_reads(path: str, direct: bool = True) -> Tuple[int, bool]:
    """Opens `path` for reading: `(fd, whether with O_DIRECT)`.

    O_DIRECT where asked for and the directory has not refused it; where opening with it
    fails with EINVAL, the refusal is recorded (`refuse_direct`) and the file is opened
    buffered.

    Raises:
        CheckpointCorruptedError: the file cannot be opened.
    """
    directory = os.path.dirname(path)
    use_direct = direct and direct_allowed(directory)
    try:
        try:
            return os.open(path, os.O_RDONLY | (os.O_DIRECT if use_direct else 0)), use_direct
        except OSError as e:
            if not use_direct or e.errno != errno.EINVAL:
                raise
            refuse_direct(directory, e, "reads")
        return os.open(path, os.O_RDONLY), False
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot be opened ({e})") from e


class DirectUnavailable(OSError):
    """O_DIRECT cannot be used for a file (its directory refused it, now or before):
    `read_spans` raises it so that the caller reads the same bytes another way."""


def _aligned_spans(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """`(offset, length)` regions widened to `ALIGN` and merged where they touch."""
    out: List[Tuple[int, int]] = []
    for offset, length in sorted(spans):
        if length <= 0:
            continue
        a = offset - offset % ALIGN
        b = -(-(offset + length) // ALIGN) * ALIGN
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return [(a, b - a) for a, b in out]


def read_spans(
    path: str,
    spans: Sequence[Tuple[int, int]],
    deliver: Callable[[int, memoryview], None],
    request: int = CHUNK_READ,
    depth: int = DEPTH,
) -> bool:
    """Reads several regions of one file with O_DIRECT as one pipeline of requests.

    The regions are widened to `ALIGN` and merged where they touch, then read through one
    bounce buffer (cut into slots of `request` bytes, at least `depth` of them and at most
    twice that, in huge pages where the kernel gives them) with `depth` requests in flight
    across the regions' ends (`inflight.read_spans_through_slots`: slots beyond `depth` take
    the next requests while completed ones wait to be delivered). The caller picks out the bytes it asked for:
    deliveries also carry the alignment's bytes around them.

    Args:
        path: the file.
        spans: `(offset, length)` of each region.
        deliver: called as `deliver(file_offset, data)` for each request, in file order, in
            the calling thread; `data` is valid only during the call.
        request: bytes per request at most (rounded down to `ALIGN`, at most the slot).
        depth: requests in flight.

    Returns:
        True when every byte was read; False when the file ended first.

    Raises:
        DirectUnavailable: the directory does not allow O_DIRECT (refused now or before;
            recorded with `refuse_direct`). Some deliveries may have been made.
        CheckpointCorruptedError: the file cannot be opened or read.
        Exception: whatever `deliver` or the `faults` seam raised.
    """
    directory = os.path.dirname(path)
    if not direct_allowed(directory):
        raise DirectUnavailable(errno.EINVAL, f"O_DIRECT refused in {directory}")
    merged = _aligned_spans(spans)
    for offset, length in merged:
        faults.check("read", path, offset, length, True)
    if not merged:
        return True
    fd, opened_direct = open_for_reads(path)
    if not opened_direct:  # refused on opening (and recorded)
        os.close(fd)
        raise DirectUnavailable(errno.EINVAL, f"O_DIRECT refused in {directory}")
    bounce = buffers.bounce()
    try:
        depth = max(1, min(depth, buffers.BOUNCE // ALIGN))
        step = max(ALIGN, min(buffers.BOUNCE // depth, request) // ALIGN * ALIGN)
        view = memoryview(bounce)  # type: ignore[arg-type]
        # the slots the bounce buffer holds, up to twice `depth`: those beyond `depth` take
        # the next requests while completed ones wait to be delivered
        count = min(buffers.BOUNCE // step, 2 * depth)
        slots = [view[i * step : (i + 1) * step] for i in range(count)]
        try:
            return read_spans_through_slots(fd, merged, slots, deliver, depth)
        except OSError as e:
            if e.errno == errno.EINVAL:
                refuse_direct(directory, e, "reads")
                raise DirectUnavailable(e.errno, str(e)) from e
            raise CheckpointCorruptedError(f"{path}: read failed ({e})") from e
    finally:
        buffers.give_back(bounce)
        os.close(fd)


def read_file(path: PathLike) -> torch.Tensor:
    """Reads a whole file into a new uint8 tensor (buffered, in large requests).

    Raises:
        OSError: the file cannot be opened (FileNotFoundError when missing) or read.
        CheckpointCorruptedError: the file shrank while it was being read.
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        faults.check("read", path, 0, size, False)
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got : min(size, got + CHUNK_READ)]], got)
            if not n:
                raise CheckpointCorruptedError(f"{path}: file shrank while reading")
            got += n
    finally:
        os.close(fd)
    return buffer


# ---- writes ------------------------------------------------------------------------------


def pwrite_all(
    fd: int, view: memoryview, offset: int, path: str = "", direct: bool = False
) -> None:
    """Writes all of `view` at `offset` of `fd` (the fault seam sees `path`)."""
    limit = faults.check("write", path, offset, len(view), direct)
    if limit is not None:  # an injected crash part-way through this request
        view = view[:limit]
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if limit is not None:
        faults.die()


def _preallocate(fd: int, size: int) -> None:
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, -(-size // ALIGN) * ALIGN)
        except OSError:  # not supported here; the writes allocate as they go
            pass


@functools.cache
def libc_function(
    name: str, argtypes: Optional[Tuple[Any, ...]] = None
) -> Optional[Callable[..., int]]:
    """The C library's function `name` (errors left in `ctypes.get_errno()`), on Linux only.
    Looked up once per `(name, argtypes)`: callers call this where they call the function.

    Args:
        name: the symbol, e.g. "sync_file_range".
        argtypes: its ctypes argument types, when the call needs them converted.

    Returns:
        The function, or None where the platform is not Linux or its C library lacks it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    return fn  # type: ignore[no-any-return]


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait
_SYNC_FILE_RANGE_ARGS = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Starts writing a just-written range of a buffered file to the disk, without waiting.

    Buffered writes otherwise sit in the page cache until the final fsync (the kernel's
    background writeback starts only past `dirty_background_ratio` of memory), so the disk
    would idle while a file is written and then take it all at once. Starting each range's
    writeback as soon as it is written overlaps the disk with the writing of the next one
    (the call waits only when the device's queue is full). A no-op where `sync_file_range`
    is missing (not Linux); the caller's fsync makes the file durable either way.
    """
    call = libc_function("sync_file_range", _SYNC_FILE_RANGE_ARGS)
    if call is not None and length > 0:
        call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # errors: the caller's fsync reports them


class FileWriter:
    """Writes one file in positional requests; switches to buffered I/O if O_DIRECT fails.

    Args:
        path: the file.
        size: its final size (preallocated; `finish` truncates to it).
        direct: try O_DIRECT (requests must then be aligned: offsets and lengths multiples
            of `ALIGN`, from aligned memory; the last may be padded past `size`).
        exclusive: create the file, failing with FileExistsError if it exists (otherwise an
            existing file is truncated).
        preallocate: reserve `size` bytes up front.
        overwrite: the file must exist and is written over in place, not truncated first
            (its blocks are reused; `finish` truncates it to `size`). FileNotFoundError if
            it does not exist.
    """

    def __init__(
        self,
        path: PathLike,
        size: int,
        direct: bool,
        exclusive: bool = False,
        preallocate: bool = True,
        overwrite: bool = False,
    ) -> None:
        self.path, self.size = os.fspath(path), size
        self._directory = os.path.dirname(self.path)
        if overwrite:
            flags = os.O_WRONLY
        else:
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        self.direct = False
        self.fd = -1
        if direct and direct_allowed(self._directory):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if isinstance(e, (FileExistsError, FileNotFoundError)):
                    raise
                refuse_direct(self._directory, e, "writes")
        if self.fd < 0:
            self.fd = os.open(self.path, flags, 0o644)
        if preallocate:
            try:
                _preallocate(self.fd, size)
            except BaseException:
                os.close(self.fd)
                raise

    def write(self, view: memoryview, offset: int) -> None:
        """Writes `view` at `offset` (both aligned when direct; `view` may be padded past EOF)."""
        if self.direct:
            try:
                pwrite_all(self.fd, view, offset, self.path, True)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refuse_direct(self._directory, e, "writes")
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_WRONLY, 0o644)
                self.direct = False
        pwrite_all(self.fd, view, offset, self.path, False)

    def finish(self) -> None:
        """Truncates the padding of the last aligned request, fsyncs and closes the file."""
        try:
            os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            self._close()

    def abort(self, remove: bool = False) -> None:
        """Closes the file after a failure (if still open); `remove` also deletes it."""
        self._close()
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
