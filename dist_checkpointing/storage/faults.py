"""Test-facing fault injection: every read and write of this package consults the installed
`Fault`s, so a test can make "the data file of rank 1" fail, hang or die half-written.
Faults live in the installing process and processes forked from it later, not spawned ones.

Example:
    with faults.injected(faults.Fault("*.distcp", error=OSError(errno.ENOSPC, "full"))):
        save(...)  # raises on this rank, like a full disk would
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

__all__ = ["Fault", "IOCall", "inject", "remove", "injected", "check", "die"]


@dataclass(frozen=True)
class IOCall:
    """One I/O request seen by a fault: the operation, file, byte range and mode."""

    op: str
    path: str
    offset: int
    nbytes: int
    direct: bool


@dataclass(eq=False)
class Fault:
    """What to do to the I/O requests on matching files, in this order: record each in
    `calls` (with no other action: a spy), sleep `delay_s`, raise `error`, and for writes
    SIGKILL the process once `die_after_bytes` bytes of the file were written.

    Args:
        pattern: `fnmatch` pattern matched against the full path and against the file name.
        ops: operations affected: "write", "read", and "replaced" (a small file such as
            `metadata.json` was just renamed into place: its delay runs after the rename).
        delay_s: seconds slept first (a slow or hung disk).
        only_direct: O_DIRECT requests only (with EINVAL: a file system refusing O_DIRECT).
    """

    pattern: str
    ops: Tuple[str, ...] = ("write",)
    error: Optional[BaseException] = None
    delay_s: float = 0.0
    die_after_bytes: Optional[int] = None
    only_direct: bool = False
    #: every matching request, in order
    calls: List[IOCall] = field(default_factory=list)

    def matches(self, op: str, path: str) -> bool:
        """Whether the fault applies to `op` on `path`."""
        return op in self.ops and (
            fnmatch.fnmatch(path, self.pattern)
            or fnmatch.fnmatch(os.path.basename(path), self.pattern)
        )


_active: List[Fault] = []
_lock = threading.Lock()


def inject(fault: Fault) -> Fault:
    """Installs `fault` (process-wide) and returns it."""
    with _lock:
        _active.append(fault)
    return fault


def remove(fault: Fault) -> None:
    """Uninstalls `fault` (no-op if it is not installed)."""
    with _lock:
        if fault in _active:
            _active.remove(fault)


@contextlib.contextmanager
def injected(*faults: Fault) -> Iterator[Tuple[Fault, ...]]:
    """Installs `faults` for the duration of a `with` block."""
    for f in faults:
        inject(f)
    try:
        yield faults
    finally:
        for f in faults:
            remove(f)


def die() -> None:
    """Ends this process at once, as a crash would (no cleanup, no exit handlers)."""
    os.kill(os.getpid(), signal.SIGKILL)


def check(op: str, path: str, offset: int, nbytes: int, direct: bool) -> Optional[int]:
    """Called by the I/O functions before a request; applies the matching faults, raising
    the first matching `error`.

    Returns:
        For writes, how many bytes of the request may be written before the process must
        `die()` (None: all of them, and live on).
    """
    if not _active:
        return None
    with _lock:
        matching = [
            f for f in _active if f.matches(op, str(path)) and (direct or not f.only_direct)
        ]
    limit: Optional[int] = None
    for f in matching:
        f.calls.append(IOCall(op, str(path), offset, nbytes, direct))
        if f.delay_s:
            time.sleep(f.delay_s)
        if f.error is not None:
            raise f.error
        if f.die_after_bytes is not None and offset + nbytes > f.die_after_bytes:
            allowed = max(0, f.die_after_bytes - offset)
            limit = allowed if limit is None else min(limit, allowed)
    return limit
