"""Rebuilding lost local checkpoint parts from their parity group (`ParityReplicationStrategy`).

At load, segment t of a lost member m's part is the XOR of the parity P_h that covers it
(h = `holder_of(m, t)`) and one segment of each other survivor's part (`_parity_math`). Each
survivor h rebuilds the one segment of m that its parity covers: it reads its parity chunk
by chunk (each chunk checked against the record's checksum as it is read), XORs into it the
chunks the other survivors send from their parts' memory, and sends the result to m, which
receives every segment straight into the part's buffer. So the lost node receives one part's
bytes (not k-1 parts'), the XOR is shared by the survivors, the parity read overlaps the
exchange, and memory grows by a few chunks per survivor. m keeps its part only when it
matches the digest the group recorded and its own checksums verify; any problem on any rank
is a `NoReplicasAvailableError` on every rank.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException, NoReplicasAvailableError, describe_ckpt_id
from ...integrity import checksum
from .._parity_math import ParityRecord, Records, assignment, plan_rebuild, xor_into
from ._stream import wait_all
from .parity import PARITY
from .strategies import CkptID, host_group

__all__ = ["ParityReader", "rebuildable", "rebuild_lost_parts"]

logger = logging.getLogger(__name__)

#: chunk rounds in flight on a survivor (receives posted ahead, sends to the lost member)
WINDOW = 2

#: a parity record opened for reading: `(record, read(offset, out), where)`; `read` fills
#: `out` with the parity bytes from `offset` (unchecked; the caller checks each chunk)
ParityReader = Tuple[ParityRecord, Callable[[int, np.ndarray], None], str]


def rebuildable(iteration: int, lost: Set[int], present: Set[int], records: Records) -> bool:
    """Pure: whether every lost part of `iteration` can be rebuilt from parity."""
    return not plan_rebuild(iteration, lost, present, records)[1]


def rebuild_lost_parts(
    manager: Any,
    iteration: int,
    lost: Set[int],
    held: Dict[CkptID, torch.Tensor],
    records: Records,
) -> None:
    """Collective (all ranks): rebuilds each lost part of `iteration` on its owner from its
    group's surviving parts (each survivor's own, verified, in `held`) and parity records,
    verifies it and puts it into `held`.

    Raises:
        NoReplicasAvailableError: on every rank, when a lost part cannot be rebuilt (two
            losses in a group, a damaged or missing parity record, a failed verification).
    """
    me, session = _dist.get_rank(), manager.session_id
    present = set(range(_dist.get_world_size())) - lost
    groups, problems = plan_rebuild(iteration, lost, present, records)
    what = f"local checkpoint of iteration {iteration} (session {session!r})"
    if problems:
        raise NoReplicasAvailableError(
            f"Cannot rebuild lost parts of the {what}: " + "; ".join(problems)
        )
    target = next((m for m, g in groups.items() if me in g and me != m), None)
    reader: Optional[ParityReader] = None
    error, key = "", None  # key: the record's (sizes, digests, segment, chunk)
    if target is not None:
        try:
            reader = manager._parity_reader((iteration, me, session, PARITY))
            record = reader[0]
            own = held[(iteration, me, session)].numpy()
            _check_record(record, (iteration, session), groups[target], me, own)
            key = (record.sizes, record.digests, record.segment, record.chunk)
        except (CheckpointingException, OSError, ValueError, KeyError) as e:
            error = f"rank {me}'s parity record: {e}"
    reports: List[Any] = _dist.all_gather_object((error, key))
    bad = [e for e, _ in reports if e]
    for m, group in groups.items():
        keys = [reports[r][1] for r in group if r != m]
        if not bad and any(k != keys[0] for k in keys):
            bad.append(f"the parity records of group {group} come from different saves")
    if bad:
        raise NoReplicasAvailableError(
            f"Cannot rebuild lost parts of the {what}: " + "; ".join(bad)
        )
    error = ""
    for m, group in groups.items():
        if me in group:  # each rank is in one group: at most one rebuild here
            sizes, digests, seg, chunk = reports[next(r for r in group if r != m)][1]
            layout = _Layout(group, group.index(m), sizes, digests, seg, chunk)
            error = _exchange(manager, iteration, layout, held, reader)
    bad = [e for e in _dist.all_gather_object(error) if e]
    if bad:
        raise NoReplicasAvailableError(
            f"Cannot rebuild lost parts of the {what}: " + "; ".join(bad)
        )
    if me in groups:
        logger.info(
            "rebuilt local checkpoint part %s from parity",
            describe_ckpt_id((iteration, me, session)),
        )


def _check_record(
    record: ParityRecord, save: Tuple[int, str], group: List[int], me: int, own: np.ndarray
) -> None:
    """The record belongs to this save and group and was made from this rank's part as it is
    now (`save`: iteration, session)."""
    if (record.iteration, record.session) != save:
        raise ValueError(f"record of iteration {record.iteration}, session {record.session!r}")
    if record.group != group or record.holder != me:
        raise ValueError(
            f"record of group {record.group} held by {record.holder}, expected {group}"
        )
    i = group.index(me)
    if record.sizes[i] != own.size or record.digests[i] != _tail_digest(own):
        raise ValueError("made from another save of this rank's part")


def _tail_digest(image: np.ndarray) -> int:
    """A part's digest: the checksum of its header, checksum table and footer."""
    from .._image import _FOOTER

    if image.size < _FOOTER.size:
        return -1
    h_off = _FOOTER.unpack(image[image.size - _FOOTER.size :].tobytes())[1]
    return checksum(image[min(h_off, image.size) :])


@dataclass
class _Layout:
    """Who sends what in the rebuild of member `lost` of `group` (the same on every rank).

    Chunk c of segment t of the lost part is the part's bytes `[t*S + c*C, ...)`, at most C
    of them (S = `segment`, C = `chunk`, the records' own); bytes past a part's end are its
    zero padding and are never sent."""

    group: List[int]
    lost: int  # member index
    sizes: Sequence[int]
    digests: Sequence[int]
    segment: int
    chunk: int

    @property
    def k(self) -> int:
        return len(self.group)

    def chunks(self) -> range:
        return range(-(-self.segment // self.chunk) if self.segment else 0)

    def covered(self, h: int) -> int:
        """The segment of the lost part that member h's parity covers."""
        return assignment(h, self.lost, self.k)

    def out_len(self, h: int, c: int) -> int:
        """Bytes of the lost part in chunk c of the segment h rebuilds (0: all padding)."""
        lo = self.covered(h) * self.segment + self.chunk * c
        hi = min(lo + self.chunk, (self.covered(h) + 1) * self.segment)
        return max(0, min(hi, self.sizes[self.lost]) - lo)

    def part_offset(self, j: int, h: int, c: int) -> int:
        """Where in member j's part its contribution to h's chunk c starts."""
        return assignment(h, j, self.k) * self.segment + self.chunk * c

    def in_len(self, j: int, h: int, c: int) -> int:
        """Bytes survivor j sends survivor h for chunk c (its part's, padding excluded)."""
        return max(0, min(self.out_len(h, c), self.sizes[j] - self.part_offset(j, h, c)))


def _exchange(
    manager: Any,
    iteration: int,
    layout: _Layout,
    held: Dict[CkptID, torch.Tensor],
    reader: Optional[ParityReader],
) -> str:
    """Collective over `layout.group`: the lost member receives its part, every survivor
    rebuilds and sends the segment its parity covers. '' or this rank's error."""
    me = _dist.get_rank()
    i = layout.group.index(me)
    pg = host_group()
    if i != layout.lost:
        assert reader is not None
        own = held[(iteration, me, manager.session_id)].numpy()
        error = _rebuild_segment(layout, i, own, reader, pg)
        return f"rank {me}'s parity record: {error}" if error else ""
    try:
        _receive_part(manager, iteration, layout, held, pg)
    except (CheckpointingException, ValueError) as e:
        return f"rank {me}: {e}"
    return ""


def _rebuild_segment(
    layout: _Layout, i: int, own: np.ndarray, reader: ParityReader, pg: Any
) -> Optional[str]:
    """On survivor i: sends its contributions to the other survivors (views of its part, all
    posted at once), then per chunk of the segment its parity covers: reads and checks the
    parity chunk while that chunk's contributions arrive, XORs them in, sends the result to
    the lost member. Returns why a parity chunk was damaged or unreadable (reported once
    every message went: the lost member's result is then discarded), or None."""
    record, read, where = reader
    group, chunk = layout.group, layout.chunk
    peers = [j for j in range(layout.k) if j not in (i, layout.lost)]
    sends: List[Any] = []
    keep: List[np.ndarray] = []
    for j in peers:
        for c in layout.chunks():
            n = layout.in_len(i, j, c)
            if n:
                lo = layout.part_offset(i, j, c)
                keep.append(own[lo : lo + n])
                sends.append(dist.isend(torch.from_numpy(keep[-1]), group[j], pg, tag=c))
    rounds = [c for c in layout.chunks() if layout.out_len(i, c)]
    slots = min(WINDOW, len(rounds))
    size = min(chunk, layout.segment)
    accs = [np.empty(size, dtype=np.uint8) for _ in range(slots)]
    bufs = [[np.empty(size, dtype=np.uint8) for _ in peers] for _ in range(slots)]
    to_lost: List[Any] = [None] * slots
    error: Optional[str] = None

    def post(r: int) -> List[Any]:
        c = rounds[r]
        return [
            dist.irecv(torch.from_numpy(bufs[r % slots][p][:n]), group[j], pg, tag=c)
            for p, j in enumerate(peers)
            for n in [layout.in_len(j, i, c)]
            if n
        ]

    pending = deque(post(r) for r in range(slots))
    try:
        for r, c in enumerate(rounds):
            slot = r % slots
            if to_lost[slot] is not None:
                to_lost[slot].wait()  # its buffer is free again
            acc = accs[slot][: min(chunk, layout.segment - c * chunk)]
            if error is None:
                try:
                    read(c * chunk, acc)
                    if checksum(acc) != record.sums[c]:
                        lo = c * chunk
                        raise ValueError(
                            f"{where}: parity checksum mismatch (bytes {lo}-{lo + acc.size})"
                        )
                except (CheckpointingException, OSError, ValueError) as e:
                    error = str(e)  # keep exchanging: no peer may hang
            wait_all(pending.popleft())
            for p, j in enumerate(peers):
                n = layout.in_len(j, i, c)
                xor_into(acc[:n], bufs[slot][p][:n])
            if r + slots < len(rounds):  # this slot's receive buffers are free again
                pending.append(post(r + slots))
            out = torch.from_numpy(acc[: layout.out_len(i, c)])
            to_lost[slot] = dist.isend(out, group[layout.lost], pg, tag=c)
    finally:
        wait_all(to_lost)
        wait_all(sends)
    return error


def _receive_part(
    manager: Any,
    iteration: int,
    layout: _Layout,
    held: Dict[CkptID, torch.Tensor],
    pg: Any,
) -> None:
    """On the lost member: receives every rebuilt chunk in place, then verifies the part."""
    me, session = _dist.get_rank(), manager.session_id
    size = layout.sizes[layout.lost]
    part = torch.empty(size, dtype=torch.uint8)
    works = []
    for h in range(layout.k):
        if h == layout.lost:
            continue
        for c in layout.chunks():
            n = layout.out_len(h, c)
            if n:
                lo = layout.covered(h) * layout.segment + c * layout.chunk
                works.append(dist.irecv(part[lo : lo + n], layout.group[h], pg, tag=c))
    wait_all(works)
    if _tail_digest(part.numpy()) != layout.digests[layout.lost]:
        raise ValueError("the rebuilt part does not match the digest its group recorded")
    ckpt_id = (iteration, me, session)
    where = f"local checkpoint part {describe_ckpt_id(ckpt_id)} (rebuilt from parity)"
    checked = manager._checked(ckpt_id, (part, where))
    if not isinstance(checked, torch.Tensor):
        raise ValueError(str(checked))
    held[ckpt_id] = checked
