"""Rebuilding lost local checkpoint parts from their parity group (`ParityReplicationStrategy`).

At load, the owner of a part that no rank holds receives from each of the k-1 survivors of
its group, for each segment of its part, either the parity covering it or the segment of
the survivor's own part that this parity also covers (`contribution_ranges`), XORs them,
and keeps the result only when it matches the digest the group recorded and its own
checksums verify. Survivors check their records chunk by chunk first; any problem is a
`NoReplicasAvailableError` on every rank.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Dict, List, Optional, Set

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException, NoReplicasAvailableError, describe_ckpt_id
from ...integrity import checksum
from .. import _parity_math as pm
from .._parity_math import (
    ParityRecord,
    Records,
    contribution_ranges,
    padded_range,
    parse_record,
    plan_rebuild,
    xor_into,
)
from ._stream import wait_all
from .parity import PARITY, _buffers, _give_back
from .strategies import CkptID, host_group

__all__ = ["rebuildable", "rebuild_lost_parts"]

logger = logging.getLogger(__name__)


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
    parity: Optional[np.ndarray] = None
    error, key = "", None
    if target is not None:
        try:
            image, where = manager._load_image((iteration, me, session, PARITY))
            record, parity = parse_record(image.numpy(), where)
            _check_record(record, groups[target], me, held[(iteration, me, session)].numpy())
            key = (record.sizes, record.digests, record.segment)
        except (CheckpointingException, OSError, ValueError, KeyError) as e:
            error = f"rank {me}'s parity record: {e}"
    reports = _dist.all_gather_object((error, key))
    bad = [e for e, _ in reports if e]
    for m, group in groups.items():
        keys = [reports[r][1] for r in group if r != m]
        if not bad and any(k != keys[0] for k in keys):
            bad.append(f"the parity records of group {group} come from different saves")
    if bad:
        raise NoReplicasAvailableError(
            f"Cannot rebuild lost parts of the {what}: " + "; ".join(bad)
        )
    keys_of = {m: reports[next(r for r in g if r != m)][1] for m, g in groups.items()}
    error = _exchange(manager, iteration, groups, held, parity, keys_of)
    bad = [e for e in _dist.all_gather_object(error) if e]
    if bad:
        raise NoReplicasAvailableError(
            f"Rebuilt parts of the {what} are unusable: " + "; ".join(bad)
        )
    if me in groups:
        logger.info(
            "rebuilt local checkpoint part %s from parity",
            describe_ckpt_id((iteration, me, session)),
        )


def _check_record(record: ParityRecord, group: List[int], me: int, own: np.ndarray) -> None:
    """The record belongs to this group and was made from this rank's part as it is now."""
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


def _exchange(
    manager: Any,
    iteration: int,
    groups: Dict[int, List[int]],
    held: Dict[CkptID, torch.Tensor],
    parity: Optional[np.ndarray],
    keys_of: Dict[int, Any],
) -> str:
    """Survivors send their contributions; each lost part's owner XORs them; '' or an error.
    Messages: each contribution's segments in order, each cut at `PARITY_CHUNK`, tags 0, 1..."""
    me, session = _dist.get_rank(), manager.session_id
    pg = host_group()
    works: List[Any] = []
    keep: List[np.ndarray] = []
    for m, group in groups.items():
        if me == m or me not in group:
            continue
        seg = keys_of[m][2]
        own = held[(iteration, me, session)].numpy()
        tag = 0
        for kind, lo, hi in contribution_ranges(group.index(me), group.index(m), len(group), seg):
            for a in range(lo, hi, pm.PARITY_CHUNK):
                b = min(hi, a + pm.PARITY_CHUNK)
                assert parity is not None
                msg = parity[a:b] if kind == "parity" else padded_range([own], a, b)
                keep.append(msg)
                works.append(dist.isend(torch.from_numpy(msg), dst=m, group=pg, tag=tag))
                tag += 1
    error = ""
    if me in groups:
        try:
            _receive_rebuild(manager, iteration, groups[me], held, keys_of[me], pg)
        except (CheckpointingException, ValueError) as e:
            error = f"rank {me}: {e}"
    wait_all(works)
    return error


def _receive_rebuild(
    manager: Any,
    iteration: int,
    group: List[int],
    held: Dict[CkptID, torch.Tensor],
    key: Any,
    pg: Any,
) -> None:
    """On a lost part's owner: receives and XORs every survivor's contribution, verifies."""
    me, session = _dist.get_rank(), manager.session_id
    sizes, digests, seg = key
    k = len(group)
    acc = torch.empty((k - 1) * seg, dtype=torch.uint8)
    flat = acc.numpy()
    first, *rest = [r for r in group if r != me]
    ranges = [
        (a, min((t + 1) * seg, a + pm.PARITY_CHUNK))
        for t in range(k - 1)
        for a in range(t * seg, (t + 1) * seg, pm.PARITY_CHUNK)
    ]
    # the first survivor's chunk lands in place, the others' in buffers XORed into it; two
    # rounds in flight, so the next round arrives while this one is XORed
    slots = min(2, len(ranges))
    bufs = _buffers(slots * len(rest))

    def post(i: int) -> List[Any]:
        a, b = ranges[i]
        base = (i % slots) * len(rest)
        return [dist.irecv(acc[a:b], src=first, group=pg, tag=i)] + [
            dist.irecv(torch.from_numpy(bufs[base + j][: b - a]), src=r, group=pg, tag=i)
            for j, r in enumerate(rest)
        ]

    pending = deque(post(i) for i in range(slots))
    try:
        for i, (a, b) in enumerate(ranges):
            wait_all(pending.popleft())
            base = (i % slots) * len(rest)
            for j in range(len(rest)):
                xor_into(flat[a:b], bufs[base + j][: b - a])
            if i + slots < len(ranges):
                pending.append(post(i + slots))
    finally:
        _give_back(bufs)
    size = sizes[group.index(me)]
    if _tail_digest(flat[:size]) != digests[group.index(me)]:
        raise ValueError("the rebuilt part does not match the digest its group recorded")
    ckpt_id = (iteration, me, session)
    where = f"local checkpoint part {describe_ckpt_id(ckpt_id)} (rebuilt from parity)"
    checked = manager._checked(ckpt_id, (acc[:size], where))
    if not isinstance(checked, torch.Tensor):
        raise ValueError(str(checked))
    held[ckpt_id] = checked
