"""Progress bars for long checkpoint operations, on rank 0 when stderr is a terminal."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator, Optional

from . import _dist

__all__ = ["byte_progress", "SHOW_AFTER_S"]

#: a bar appears only once an operation has run this long (short ones stay quiet)
SHOW_AFTER_S = 3.0


@contextlib.contextmanager
def byte_progress(desc: str, total: int) -> Iterator[Optional[Callable[[int], None]]]:
    """Yields a thread-safe `advance(nbytes)` driving a tqdm bar of `total` bytes (rank 0, on
    a terminal, after `SHOW_AFTER_S` s; removed at the end), or None."""
    if total <= 0 or _dist.get_rank() != 0 or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # a dependency; imported only when a bar can be shown

    lock = threading.Lock()
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, delay=SHOW_AFTER_S, leave=False
    ) as bar:

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        yield advance
