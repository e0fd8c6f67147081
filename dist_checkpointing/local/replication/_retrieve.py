"""Streamed retrieval at load: a part another rank needs is sent while it is read.

A recovery plan (`plan_retrieval`) names, for each rank that lost its part, a holder that
sends a copy. `stream_transfers` runs the plan's transfers between different ranks:

- Sender: reads the part front to back into one page-aligned buffer, through the same read
  path and request depth as a part loaded here (`.._read`: several requests in flight;
  measured 1.5-3x faster than one at a time for these reads on the CI VM), and posts each
  chunk's send (`CHUNK_BYTES`) as soon as the read has filled it. The part is read once.
- Receiver: posts every chunk's receive at once, into one buffer (the part's final memory).

So the holder's disk, the wire and the receiver run at the same time, instead of the
holder reading the whole part and only then sending it. Verification is the receiver's
(it has the bytes anyway): a copy that fails it is reported by the caller, as is a part
the holder could not open (its size is exchanged as -1 and nothing is sent) or could not
read to the end (the rest is sent as zeros, so every posted receive completes).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Protocol, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException
from ...storage import ALIGN

__all__ = ["PartSource", "MemorySource", "stream_transfers", "CHUNK_BYTES"]

logger = logging.getLogger(__name__)

#: bytes per chunk read and sent
CHUNK_BYTES = 16 << 20
#: tags of one transfer's chunks: transfer index * _TAG_SPAN + chunk index
_TAG_SPAN = 1 << 20

CkptID = Tuple[Any, ...]
#: (sender, receiver, part id), the transfers of a plan in plan order
Transfer = Tuple[int, int, CkptID]


class PartSource(Protocol):
    """A stored part, read front to back."""

    size: int

    def read_into(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        """Fills `out` (flat uint8, `size` bytes) with the part's bytes, calling
        `progress(filled)` with the growing number of leading bytes filled.

        Raises:
            CheckpointingException, OSError: the bytes cannot be read.
        """
        ...


class MemorySource:
    """A part already in memory (a uint8 tensor), as a `PartSource`."""

    def __init__(self, image: torch.Tensor) -> None:
        self.flat = image.numpy()
        self.size = int(self.flat.size)

    def read_into(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        out[:] = self.flat
        progress(self.size)


#: opens a part held here (raises CheckpointingException or OSError when it cannot)
OpenSource = Callable[[CkptID], PartSource]


def _chunks(size: int) -> List[Tuple[int, int]]:
    return [(lo, min(size, lo + CHUNK_BYTES)) for lo in range(0, size, CHUNK_BYTES)]


def _send(group: Any, receiver: int, tag: int, source: PartSource, what: str) -> bool:
    """Reads `source`, sending each chunk as soon as it is read; False if the read failed
    (the chunks not yet sent are then sent as zeros, so the receiver's posts complete)."""
    chunks = _chunks(source.size)
    spare = torch.empty(source.size + ALIGN, dtype=torch.uint8)
    skip = (-spare.data_ptr()) % ALIGN  # page-aligned: O_DIRECT reads land in place
    flat = spare[skip : skip + source.size]
    works: List[Any] = []

    def post(filled: int) -> None:
        while len(works) < len(chunks) and chunks[len(works)][1] <= filled:
            lo, hi = chunks[len(works)]
            works.append(dist.isend(flat[lo:hi], dst=receiver, group=group, tag=tag + len(works)))

    ok = True
    try:
        try:
            source.read_into(flat.numpy(), post)
        except (CheckpointingException, OSError) as e:
            logger.warning("cannot read %s to send it to rank %d: %s", what, receiver, e)
            ok = False
            flat[chunks[len(works)][0] if len(works) < len(chunks) else 0 :].zero_()
        post(source.size)
    finally:
        for w in works:
            if w is not None:
                w.wait()
    return ok


def stream_transfers(
    group: Any,
    transfers: Sequence[Transfer],
    me: int,
    open_source: OpenSource,
) -> Tuple[Dict[CkptID, Tuple[int, torch.Tensor]], List[CkptID]]:
    """Collective over `group` (all ranks): runs the transfers between different ranks.

    Transfers with sender == receiver are skipped (the receiver keeps its own copy). Sends
    of several parts from this rank run one after another in this thread, after every
    receive is posted.

    Args:
        group: a gloo group over all ranks (None: the default group).
        transfers: the plan's transfers, the same on every rank.
        me: this rank.
        open_source: opens a part held here.

    Returns:
        `(received, unsent)`: the parts received here, `id -> (sender, bytes)`, not
        verified; and the parts this rank could not read (wholly or in part) for sending.

    Raises:
        DistributedFailureError: another rank died or timed out in the size exchange; the
            process group's error from a send or receive.
    """
    sources: Dict[int, PartSource] = {}
    unsent: List[CkptID] = []
    for index, (sender, receiver, id_) in enumerate(transfers):
        if sender == me != receiver:
            try:
                sources[index] = open_source(id_)
            except (CheckpointingException, OSError) as e:
                logger.warning("cannot open part %s to send it to rank %d: %s", id_, receiver, e)
                unsent.append(id_)
    sizes: Dict[int, int] = {}
    mine = {
        i: (sources[i].size if i in sources else -1)
        for i, (sender, receiver, _) in enumerate(transfers)
        if sender == me != receiver
    }
    for part in _dist.all_gather_object(mine, group):
        sizes.update(part)
    received: Dict[CkptID, Tuple[int, torch.Tensor]] = {}
    works = []
    for index, (sender, receiver, id_) in enumerate(transfers):
        if receiver != me or sender == me or sizes.get(index, -1) < 0:
            continue
        buf = torch.empty(sizes[index], dtype=torch.uint8)
        for k, (lo, hi) in enumerate(_chunks(sizes[index])):
            works.append(dist.irecv(buf[lo:hi], src=sender, group=group, tag=index * _TAG_SPAN + k))
        received[id_] = (sender, buf)
    try:
        for index, source in sources.items():
            _, receiver, id_ = transfers[index]
            if not _send(group, receiver, index * _TAG_SPAN, source, f"part {id_}"):
                unsent.append(id_)
    finally:
        for w in works:
            if w is not None:
                w.wait()
    return received, unsent
