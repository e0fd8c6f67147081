"""Shared-memory windows through which the ranks of one node pass each other file bytes.

When several ranks of a node need strided parts of the same stored bytes (a column block of
row-major chunks: every rank needs a slice of every row), one of them reads each range
with O_DIRECT into a window of its `Segment`, and every rank that needs it copies its part
out. The node reads each byte once, at the speed of direct reads, and no page cache is
filled (filling it ran at about half the disk's rate on the machines we measured).

A `Segment` is one rank's file in `/dev/shm`: a control area (a state word saying whether
the rank failed, then process-shared POSIX semaphores, two per rank of the world) followed
by `slots` windows. A reader posts `ready` semaphores in its consumers' segments when a
window is filled; a consumer posts `free` semaphores in the reader's segment when it no
longer needs the window. Semaphores order the memory accesses (a plain flag would not, on
every architecture), and waits are timed: a waiting rank looks at its peers between
waits, so a peer that failed or died stops the others within `POLL_S` instead of hanging
them (`wait`).

The segment's pages are reserved when it is created (`posix_fallocate`): a full `/dev/shm`
(64 MiB in a default container) is an `OSError` then, never a SIGBUS in the middle of a
load. Segments are unlinked by their owner after the load's last collective; ones left by
a process that died are removed by the next `Segment.create` on the node.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import socket
import sys
import time
import uuid
from typing import Callable, List, Optional

import numpy as np

from ..errors import CheckpointingException
from .direct import libc_function

__all__ = [
    "Segment",
    "SharedReadAborted",
    "available",
    "node_id",
    "post",
    "wait",
]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "dist_ckpt_share"
#: bytes per semaphore in the control area (a `sem_t` is 32 bytes on 64-bit Linux; a
#: cache line each keeps ranks posting different semaphores off each other's lines)
SEM_STRIDE = 64
#: seconds between looks at the peers while waiting
POLL_S = 0.2


class SharedReadAborted(CheckpointingException):
    """A rank stopped waiting for a peer of its node that failed, died, or made no progress."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _sem(name: str, args: tuple) -> Callable[..., int]:
    fn = libc_function(name, args)
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not available")
    return fn


def available() -> bool:
    """Whether node-shared windows can be used here: Linux, a writable `/dev/shm`, and the
    C library's process-shared semaphores."""
    if not sys.platform.startswith("linux") or not os.access(SHM_DIR, os.W_OK):
        return False
    return all(
        libc_function(n, a) is not None
        for n, a in (
            ("sem_init", (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)),
            ("sem_post", (ctypes.c_void_p,)),
            ("sem_timedwait", (ctypes.c_void_p, ctypes.POINTER(_Timespec))),
        )
    )


def node_id() -> str:
    """Identifies this machine (host name and boot): ranks with the same id share memory."""
    boot = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _remove_stale() -> None:
    """Removes segments of processes of this machine that are gone (names carry the pid)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if not name.startswith(PREFIX + "-"):
                continue
            try:
                pid = int(name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    logger.info("removed %s, left by process %d", name, pid)


class Segment:
    """One rank's control area and windows in `/dev/shm` (see the module docstring).

    Use `create` for the rank's own segment and `attach` for a peer's; `window(i)` is a
    uint8 view of window `i`. Views must be dropped before `close`.

    Args:
        path: the file.
        world: ranks in the world (the control area holds two semaphores per rank).
        slots: windows.
        slot_bytes: bytes per window (a multiple of the page size).
        create: make the file (exclusively), reserve its pages and set up the semaphores.
    """

    def __init__(self, path: str, world: int, slots: int, slot_bytes: int, create: bool) -> None:
        self.path, self.world, self.slots, self.slot_bytes = path, world, slots, slot_bytes
        self.control = -(-(SEM_STRIDE * (1 + 2 * world)) // mmap.PAGESIZE) * mmap.PAGESIZE
        size = self.control + slots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise
            elif os.fstat(fd).st_size < size:
                raise CheckpointingException(
                    f"{path}: shared segment of {os.fstat(fd).st_size} bytes, expected {size}"
                )
            self._mm: Optional[mmap.mmap] = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            if fd >= 0:
                os.close(fd)
        self._bytes: Optional[np.ndarray] = np.frombuffer(self._mm, dtype=np.uint8)
        self._state = self._bytes[:8].view(np.int64)
        self.base = int(self._bytes.ctypes.data)
        if create:
            init = _sem("sem_init", (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint))
            for i in range(2 * world):
                if init(self._sem(i), 1, 0) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init failed")

    @classmethod
    def create(cls, world: int, slots: int, slot_bytes: int) -> Segment:
        """Makes this rank's segment (a new file; stale ones of dead processes removed).

        Raises:
            OSError: `/dev/shm` cannot hold it (ENOSPC) or refuses it.
        """
        _remove_stale()
        name = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return cls(os.path.join(SHM_DIR, name), world, slots, slot_bytes, create=True)

    @classmethod
    def attach(cls, path: str, world: int, slots: int, slot_bytes: int) -> Segment:
        """Maps a peer's segment.

        Raises:
            OSError, CheckpointingException: it is missing or smaller than expected.
        """
        return cls(path, world, slots, slot_bytes, create=False)

    def _sem(self, i: int) -> int:
        return self.base + SEM_STRIDE * (1 + i)

    def ready_sem(self, sender: int) -> int:
        """Address of the semaphore `sender` posts when a window it read is ready for us."""
        return self._sem(sender)

    def free_sem(self, sender: int) -> int:
        """Address of the semaphore `sender` posts when it is done with one of our windows."""
        return self._sem(self.world + sender)

    def window(self, i: int) -> np.ndarray:
        """A uint8 view of window `i`."""
        assert self._bytes is not None
        start = self.control + i * self.slot_bytes
        return self._bytes[start : start + self.slot_bytes]

    @property
    def failed(self) -> bool:
        """Whether the owner said it failed."""
        return bool(self._state[0] != 0)

    def mark_failed(self) -> None:
        """Tells the peers that this rank stopped (they stop waiting for it)."""
        self._state[0] = 1

    def close(self) -> None:
        """Unmaps the segment (its views must be gone; the file stays until `unlink`)."""
        self._state = None  # type: ignore[assignment]
        self._bytes = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped with it
                self._mm.close()
            self._mm = None

    def unlink(self) -> None:
        """Removes the file (mappings stay valid until closed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def post(sem: int) -> None:
    """Posts a semaphore (`Segment.ready_sem` / `free_sem`)."""
    if _sem("sem_post", (ctypes.c_void_p,))(sem) != 0:
        raise OSError(ctypes.get_errno(), "sem_post failed")


def wait(sem: int, check: Callable[[], None], stall_s: float, what: str) -> None:
    """Waits for a semaphore, calling `check` every `POLL_S` seconds while it is not posted.

    Args:
        sem: the semaphore's address.
        check: raises if the wait is pointless (a peer failed or died).
        stall_s: give up after this many seconds without the post.
        what: what is waited for, for the error.

    Raises:
        SharedReadAborted: no post within `stall_s`; whatever `check` raises.
    """
    timedwait = _sem("sem_timedwait", (ctypes.c_void_p, ctypes.POINTER(_Timespec)))
    deadline = time.monotonic() + stall_s
    while True:
        now = time.time() + POLL_S
        ts = _Timespec(int(now), int((now % 1) * 1e9))
        if timedwait(sem, ctypes.byref(ts)) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"sem_timedwait failed while waiting for {what}")
        check()
        if time.monotonic() > deadline:
            raise SharedReadAborted(f"no progress in {stall_s:.0f} s waiting for {what}")


def peers_check(
    segments: List[Optional[Segment]], pids: List[int], ranks: List[int]
) -> Callable[[], None]:
    """A `wait` check that raises when one of `ranks` marked its segment failed or died."""

    def check() -> None:
        for r in ranks:
            seg = segments[r]
            if seg is not None and seg.failed:
                raise SharedReadAborted(f"rank {r} of this node failed during a shared read")
            if not _alive(pids[r]):
                raise SharedReadAborted(f"rank {r} of this node (pid {pids[r]}) died")

    return check
