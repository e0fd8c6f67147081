"""Which ranks are gone after a collective failed.

A failed gloo collective says little about who was lost: the ranks next to the dead one
see a connection closed by a peer address, the others only a timeout, and a timeout closes
that group's connections to live ranks as well. So the ranks join one more small gloo group
of their own (`prepare`, collective, before the step whose failure must be explained),
which a failed collective elsewhere leaves untouched and which carries no traffic. When a
process dies its operating system closes its connections, so afterwards `lost_ranks` finds
the dead ranks as the peers whose connection in that group is closed: an operation posted
to them fails at once, while one posted to a live rank (still failing, or already done)
just waits. Nobody has to answer, so ranks that finished, or notice the failure later, or
never, change nothing.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from . import _dist
from .errors import DistributedFailureError

__all__ = ["prepare", "lost_ranks"]

logger = logging.getLogger(__name__)

_group: Any = None
_key: Any = None
_TAG = 0x1DC0  # apart from the small tags user code tends to pick
_SETTLE_S = 0.5  # for a closing that this process's gloo thread is still handling


def prepare() -> None:
    """Collective: makes sure the group `lost_ranks` looks at exists (once per process
    group and collective timeout; a no-op without a process group)."""
    global _group, _key
    if not _dist.is_distributed():
        return
    key = (id(dist.group.WORLD), _dist.get_collective_timeout())
    if _group is not None and _key == key:
        return
    try:
        _group = _dist.new_own_group(
            backend="gloo",
            timeout=datetime.timedelta(seconds=_dist.get_collective_timeout()),
        )
    except RuntimeError as e:
        error = DistributedFailureError(
            f"Checkpoint collective creating the liveness group failed: another rank died or "
            f"did not answer within {_dist.get_collective_timeout():.0f} s ({e})"
        )
        error.peer_lost = True  # type: ignore[attr-defined]
        raise error from e
    _key = key


def lost_ranks() -> List[int]:
    """After this rank's collective failed: the other ranks whose connection to this one
    is closed, that is, whose process is gone. A rank whose whole host vanished (no closing
    reaches this one) is not found. Needs `prepare` to have run on every rank before the
    failure; without it, or without a process group, the result is empty."""
    if _group is None or not _dist.is_distributed():
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    lost: List[int] = []
    pending: List[Tuple[int, Any]] = []
    for peer in range(world):
        if peer == rank:
            continue
        try:
            pending.append((peer, dist.irecv(torch.empty(1), peer, group=_group, tag=_TAG)))
        except RuntimeError:  # the connection is closed already
            lost.append(peer)
    deadline = time.monotonic() + _SETTLE_S
    while pending and time.monotonic() < deadline:
        still: List[Tuple[int, Any]] = []
        for peer, work in pending:
            if not work.is_completed():
                still.append((peer, work))
                continue
            try:
                work.wait()  # nobody sends on this group: a finished receive has failed
            except RuntimeError:
                lost.append(peer)
        pending = still
        time.sleep(0.02)
    # the receives still posted to live ranks stay unanswered; the group goes at teardown
    logger.info("ranks lost after the failure: %s", _dist.rank_ranges(lost) or "none found")
    return sorted(lost)
