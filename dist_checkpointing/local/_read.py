"""Reading a local checkpoint part at disk speed, verified as it lands.

`read_part` reads the small end of the file first (footer, header, checksum table), then
the tensor bytes in large requests through the shared read path (`storage.read_region`:
O_DIRECT or the page cache as measured per file system, huge pages for fresh memory), and
hashes each tensor's bytes request by request while they are still in the CPU caches, so
a load makes one pass over memory instead of a read and then a verification pass.

The destination is fresh host memory (the loaded CPU tensors are views of it), or, when
every tensor of the part goes back to CUDA, a pooled page-locked buffer (the same pool the
saves stage into), from which the device copies run asynchronously; it is handed back with
`release_part` once the copies are done.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CheckpointCorruptedError
from ..integrity import checksum, new_hasher
from ..storage import ALIGN, read_region
from ._image import _FOOTER, _POOL, _POOL_GRANULE, FORMAT_VERSION, MAGIC, _Layout, load_header

__all__ = ["Part", "FilePartSource", "read_part", "release_part"]

#: bytes per read request (each request's bytes are hashed at once), as `torch_dist` loads
REQUEST = 8 << 20


@dataclass
class Part:
    """A part's bytes, its tensors verified.

    `pooled` is the pool buffer behind `buffer` (a page-locked one, for CUDA destinations),
    or None for fresh memory.
    """

    buffer: torch.Tensor
    pooled: Optional[torch.Tensor] = None


def release_part(part: Part) -> None:
    """Hands a pooled part buffer back (nothing may view it afterwards)."""
    if part.pooled is not None:
        pooled, part.pooled = part.pooled, None
        _POOL.release(_Layout(int(pooled.numel())), pooled)


class FilePartSource:
    """A part file, read front to back (to stream it to another rank) the way `read_part`
    reads one (`REQUEST`-sized requests, `DEPTH` in flight), without verifying it (the
    receiver does).

    Args:
        path: the file.

    Raises:
        OSError: the file cannot be found (FileNotFoundError) or examined.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.stat(path).st_size
        self.direct = True  # O_DIRECT where the file system allows it, as torch_dist loads

    def read_into(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        """Fills `out` with the file's first `out.size` bytes, `progress(filled)` after
        each request.

        Raises:
            CheckpointCorruptedError: the file is shorter, or the read failed.
        """
        read_region(self.path, 0, out, self.direct, progress, REQUEST)


def _devices(state: Any) -> List[str]:
    """The devices the part's tensors were saved from (both state classes record them)."""
    devices = getattr(state, "_devices", None)
    if devices is None and hasattr(state, "placeholders"):
        devices = [h.device for h in state.placeholders()]
    return [str(d) for d in devices or []]


class _Hashes:
    """Hashes each tensor's bytes as the read fills the buffer, then checks its digest."""

    def __init__(
        self,
        flat: np.ndarray,
        slots: List[Tuple[int, int]],
        sums: np.ndarray,
        where: str,
        names: Any,
    ) -> None:
        self.flat, self.slots, self.sums, self.where, self.names = flat, slots, sums, where, names
        self.i, self.done, self.hasher = 0, 0, new_hasher()

    def __call__(self, filled: int) -> None:
        while self.i < len(self.slots):
            off, n = self.slots[self.i]
            lo, hi = max(self.done, off), min(filled, off + n)
            if hi > lo:
                self.hasher.update(self.flat[lo:hi])
            if filled < off + n:
                break
            if self.hasher.intdigest() != int(self.sums[self.i]):
                label = (
                    self.names[self.i]
                    if isinstance(self.names, list) and self.i < len(self.names)
                    else f"#{self.i}"
                )
                raise CheckpointCorruptedError(
                    f"{self.where}: checksum mismatch in tensor {label} (bytes {off}-{off + n})"
                )
            self.hasher.reset()
            self.i += 1
        self.done = max(self.done, filled)


def reader_threads(nbytes: int) -> int:
    """Threads reading one part: about one per 2 cores of this rank's share of the machine
    (ranks on the node from `LOCAL_WORLD_SIZE`, else the world size), but at least
    `4 // ranks` (the threads wait on the disk, not on the CPU: the node's ranks together
    keep about 4 threads' worth of requests in flight), at most 4, and none for less than
    64 MiB each. A GPU node with 16 cores per rank reads with 4, which a fast NVMe disk
    needs to reach its speed; the 2-core CI VM with 2 ranks with 2 (two processes reading
    512 MiB each, page cache dropped, 4 alternated rounds: 1.33 s median with 2 threads,
    2.02 s with 1, faster in every round), with 4 ranks with 1 (four processes reading 256 MiB
    each: 2 threads per rank 3.14 s median against 3.64 s, faster in only 2 of 4 rounds)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if env.isdigit() and int(env) > 0:
        ranks = int(env)
    elif dist.is_available() and dist.is_initialized():
        ranks = dist.get_world_size()
    else:
        ranks = 1
    wanted = max(int(cores / ranks // 2), 4 // ranks)
    return max(1, min(4, wanted, nbytes // (64 << 20)))


def _read_parallel(path: str, out: np.ndarray, direct: bool, hashes: _Hashes, threads: int) -> None:
    """Reads `out.size` bytes of `path` from offset 0, `threads` contiguous ranges at once.

    `hashes` follows the filled prefix: as the first range lands (its bytes still in the
    CPU caches), then each following range once it and those before it are complete (the
    hash holds the interpreter lock; the reads do not, so they overlap it).
    """
    if threads <= 1:
        read_region(path, 0, out, direct, hashes, REQUEST)
        return
    step = -(-out.size // threads // ALIGN) * ALIGN
    bounds = [(lo, min(out.size, lo + step)) for lo in range(0, out.size, step)]
    filled = [0] * len(bounds)
    cond = threading.Condition()

    def read(k: int) -> None:
        lo, hi = bounds[k]

        def progress(n: int) -> None:
            with cond:
                filled[k] = n
                cond.notify()

        read_region(path, lo, out[lo:hi], direct, progress, REQUEST)
        progress(hi - lo)

    def prefix() -> int:
        done = 0
        for (lo, hi), n in zip(bounds, filled):
            done = lo + n
            if n < hi - lo:
                break
        return done

    with concurrent.futures.ThreadPoolExecutor(len(bounds), "dc-local-read") as pool:
        futures = [pool.submit(read, k) for k in range(len(bounds))]
        hashed = 0
        while hashed < out.size:
            with cond:
                if prefix() == hashed and not all(f.done() for f in futures):
                    cond.wait(0.5)  # woken by progress; the timeout notices a failed reader
                upto = prefix()
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            if upto > hashed:
                hashes(upto)
                hashed = upto
            elif all(f.done() for f in futures):
                raise CheckpointCorruptedError(f"{path}: short read at offset {upto}")


def read_part(path: str, own: bool = True) -> Part:
    """Reads a part file and verifies every tensor's checksum as its bytes arrive.

    Args:
        path: the file.
        own: the part is loaded here (not only sent to another rank): a part whose tensors
            all go back to CUDA is read into a pooled page-locked buffer.

    Returns:
        The part; `decode_image(part.buffer, ..., verify=False)` parses it.

    Raises:
        FileNotFoundError: the file is missing.
        OSError: it cannot be opened.
        CheckpointCorruptedError: it is truncated, malformed or fails a checksum.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _FOOTER.size:
            raise CheckpointCorruptedError(
                f"{path}: {size} bytes, too short for a local checkpoint"
            )
        magic, h_off, h_len, count, h_sum, t_sum = _FOOTER.unpack(
            os.pread(fd, _FOOTER.size, size - _FOOTER.size)
        )
        table_off = h_off + h_len
        if magic != MAGIC or table_off + 8 * count + _FOOTER.size != size:
            raise CheckpointCorruptedError(f"{path}: not a local checkpoint file, or truncated")
        end = os.pread(fd, size - h_off, h_off)
    finally:
        os.close(fd)
    if len(end) != size - h_off:
        raise CheckpointCorruptedError(f"{path}: file shrank while reading")
    header_bytes, table = end[:h_len], np.frombuffer(end[h_len : h_len + 8 * count], "<u8")
    if checksum(header_bytes) != h_sum or checksum(table) != t_sum:
        raise CheckpointCorruptedError(f"{path}: header or checksum table mismatch")
    header = load_header(header_bytes, f"{path} (header)", True)
    entries = header.get("tensors") if isinstance(header, dict) else None
    if header.get("format") != FORMAT_VERSION or not isinstance(entries, list):
        raise CheckpointCorruptedError(f"{path}: unsupported local checkpoint header")
    try:
        slots = [(int(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError) as e:
        raise CheckpointCorruptedError(f"{path}: malformed tensor entries") from e
    if len(slots) != count or any(o < 0 or n < 0 or o + n > h_off for o, n in slots):
        raise CheckpointCorruptedError(f"{path}: invalid tensor byte ranges")
    devices = _devices(header.get("state"))
    to_cuda = own and bool(devices) and all(d.startswith("cuda") for d in devices)
    pooled: Optional[torch.Tensor] = None
    if to_cuda and torch.cuda.is_available():
        rounded = -(-(size + ALIGN) // _POOL_GRANULE) * _POOL_GRANULE
        pooled = _POOL.acquire(_Layout(rounded), pin=True)
        buffer = pooled[:size]
    else:  # fresh memory, page-aligned (O_DIRECT reads land in place)
        spare = torch.empty(size + ALIGN, dtype=torch.uint8)
        skip = (-spare.data_ptr()) % ALIGN
        buffer = spare[skip : skip + size]
    flat = buffer.numpy()
    try:
        hashes = _Hashes(flat, slots, table, path, header.get("names"))
        _read_parallel(path, flat[:h_off], True, hashes, reader_threads(h_off))
        hashes(h_off)
        if hashes.i != len(slots):
            raise CheckpointCorruptedError(f"{path}: tensor byte ranges out of order")
        flat[h_off:] = np.frombuffer(end, dtype=np.uint8)
    except BaseException:
        if pooled is not None:
            _POOL.release(_Layout(int(pooled.numel())), pooled)
        raise
    return Part(buffer, pooled)
