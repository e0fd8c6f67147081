"""Which ranks are gone after a collective failed.

A failed gloo collective says little about who was lost: the ranks next to the dead one
see a connection closed by a peer address, the others only a timeout, and a timeout closes
that group's connections to live ranks as well. So the library keeps one more gloo group
beside its coordination group (`_dist` makes both), which carries no traffic and which a
failed collective elsewhere leaves untouched. When a process dies its operating system
closes its connections, so `lost_ranks` finds the dead ranks as the peers whose connection
in that group is closed: an operation posted to them fails at once, while one posted to a
live rank (still failing, already done, or never noticing) just waits, unanswered.
"""

from __future__ import annotations

import logging
import time
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

__all__ = ["lost_ranks"]

logger = logging.getLogger(__name__)

_TAG = 0x1DC0  # apart from the small tags user code tends to pick
_SETTLE_S = 0.5  # for a closing that this process's gloo thread is still handling


def lost_ranks(group: Any) -> List[int]:
    """After this rank's collective failed: the other ranks whose connection to this one
    in `group` (the idle group, made by every rank before the failure) is closed, that is,
    whose process is gone. A rank whose whole host vanished (no closing reaches this one)
    is not found."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lost: List[int] = []
    pending: List[Tuple[int, Any]] = []
    for peer in range(world):
        if peer == rank:
            continue
        try:
            pending.append((peer, dist.irecv(torch.empty(1), peer, group=group, tag=_TAG)))
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
    logger.info("ranks whose process is gone: %s", sorted(lost) or "none found")
    return sorted(lost)
