"""Removing superseded local checkpoint parts in the background, after the commit.

Once iteration I is committed on every rank, the parts of older iterations are garbage.
Removing a part costs the disk work of freeing its blocks (on the CI VM's ext4, mounted
with `discard`, unlinking a 512 MiB part took 0.42-0.49 s; the directory's fsync after it
almost nothing), which a synchronous save used to pay before returning: 0.8-1.1 s of a
3-4 s save of 1 GiB on 2 ranks (docs/performance.md, issue 14). Nothing depends on the
removal being done when the save returns: `find_latest` chooses the newest complete
iteration, which is the committed one, whether older parts are still listed or not. So the
removal runs on one thread of its own, in the order saves committed, and `find_latest` /
`load` wait for the removals already scheduled (so that what they list is settled).

A removal that fails leaves older parts behind: logged as a warning, and retried by the
next save's removal (it removes every part older than the iteration it committed). The new
checkpoint is committed on every rank either way.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, List, Optional

from ... import _dist

__all__ = ["schedule_removal", "wait_for_removals"]

logger = logging.getLogger(__name__)

_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pending: List[concurrent.futures.Future] = []
_lock = threading.Lock()


def _thread() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dc-local-remove"
        )
        _dist.at_teardown(wait_for_removals)
    return _executor


def _run(remove: Callable[[], None], what: str) -> None:
    try:
        remove()
    except Exception as e:  # the checkpoint is committed; the next removal retries
        logger.warning("removing %s failed (left for the next save): %s", what, e)


def schedule_removal(remove: Callable[[], None], what: str) -> None:
    """Runs `remove()` on the removal thread, after the removals scheduled before it.

    Args:
        remove: removes files; its exceptions are logged, not raised.
        what: names what it removes, for the log.
    """
    with _lock:
        _pending[:] = [f for f in _pending if not f.done()]
        _pending.append(_thread().submit(_run, remove, what))


def wait_for_removals() -> None:
    """Waits until every removal scheduled so far in this process has run."""
    with _lock:
        pending = list(_pending)
    for f in pending:
        f.result()
