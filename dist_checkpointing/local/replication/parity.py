"""`ParityReplicationStrategy`: XOR parity across the nodes of a group instead of full copies.

Each rank keeps its own part plus one parity record of `S ~ part / (k-1)` bytes (the scheme
and its proof: `_parity_math`). At save, every member sends each other member the segment of
its part that member's parity covers, as raw bytes in chunks of `PARITY_CHUNK` (views of the
part where they can be; a bounded window of sends and receives in flight), and each member
XORs what it receives chunk by chunk and writes its record as it goes: memory grows by a few
chunks, not a part. At load, a part that no rank holds is rebuilt from the k-1 surviving
parts and parities of its group, each survivor sending its owner the segment its parity
covers (`_parity_rebuild.rebuild_lost_parts`), then verified by the part's own checksums; two lost members of one group raise
`NoReplicasAvailableError` on every rank.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import mmap
import threading
from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException
from ...integrity import checksum
from .. import _parity_math as pm
from .._image import LocalImage
from .._parity_math import (
    assignment,
    padded_range,
    record_trailer,
    segment_size,
    trailer_size,
    xor_into,
)
from ._stream import OpenSink, wait_all
from .strategies import CkptID, ReplicationStrategy, clique_ranks

__all__ = ["PARITY", "ParityReplicationStrategy", "parity_groups"]

logger = logging.getLogger(__name__)

#: the fourth element of a parity record's id, `(iteration, holder, session, PARITY)`
PARITY = "parity"
#: chunk rounds in flight per peer (sends and receives)
WINDOW = 2

_free: List[np.ndarray] = []
_lock = threading.Lock()


def _buffers(n: int) -> List[np.ndarray]:
    """`n` page-aligned buffers of `PARITY_CHUNK` bytes, reused across saves."""
    with _lock:
        fits = [b for b in _free if b.size == pm.PARITY_CHUNK][:n]
        _free[:] = [b for b in _free if all(b is not f for f in fits)]
        got = fits
    return got + [
        np.frombuffer(mmap.mmap(-1, pm.PARITY_CHUNK), dtype=np.uint8) for _ in range(n - len(got))
    ]


def _give_back(bufs: List[np.ndarray]) -> None:
    with _lock:
        _free.extend(bufs[: max(0, 16 - len(_free))])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parity_groups(world_size: int, replication_jump: int, group_size: int) -> List[List[int]]:
    """The parity groups `r, r+J, ..., r+(k-1)J` (k ranks on k different nodes).

    Raises:
        CheckpointingException: naming the parameter at fault.
    """
    if not _is_int(replication_jump) or replication_jump < 1:
        raise CheckpointingException(
            f"replication_jump (ranks per node) must be a positive int, got {replication_jump!r}"
        )
    if not _is_int(group_size) or group_size < 2:
        raise CheckpointingException(
            f"group_size (nodes per parity group) must be an int >= 2, got {group_size!r}"
        )
    if world_size % replication_jump:
        raise CheckpointingException(
            f"World size {world_size} is not a multiple of replication_jump={replication_jump}"
        )
    nodes = world_size // replication_jump
    if nodes < group_size or nodes % group_size:
        raise CheckpointingException(
            f"group_size={group_size} must divide the number of nodes, world size {world_size} "
            f"/ replication_jump {replication_jump} = {nodes}"
        )
    return clique_ranks(world_size, replication_jump, group_size)


class ParityReplicationStrategy(ReplicationStrategy):
    """Each rank keeps its own part and one XOR parity segment of its group's parts.

    Args:
        group: the gloo process group of this rank's parity group (None: all ranks).
        ranks: the group's ranks, in member order.
    """

    def __init__(self, group: Any, ranks: Sequence[int]) -> None:
        self.group = group
        self.ranks = list(ranks)

    @classmethod
    def from_replication_params(
        cls,
        replication_jump: Optional[int] = None,
        group_size: int = 2,
        *,
        timeout: Optional[datetime.timedelta] = None,
    ) -> ParityReplicationStrategy:
        """Collective: creates one gloo group per parity group; returns this rank's strategy.

        Args:
            replication_jump: J, the ranks per node (the distance between members); default:
                the number of local CUDA devices, or 1 without CUDA.
            group_size: k, the members (nodes) of a parity group; k = 2 is mirroring.
            timeout: how long a background exchange waits for a peer (default: the group's).

        Raises:
            CheckpointingException: on every rank, for parameters that do not fit the world.
        """
        jump = max(1, torch.cuda.device_count()) if replication_jump is None else replication_jump
        groups = parity_groups(_dist.get_world_size(), jump, group_size)
        me = _dist.get_rank()
        mine: Any = None
        ranks: List[int] = []
        for members in groups:  # every rank creates every group
            if _dist.is_distributed():
                group = _dist.new_own_group(members, backend="gloo", timeout=timeout)
                mine = group if me in members else mine
            ranks = members if me in members else ranks
        logger.debug("parity groups %s (rank %d)", groups, me)
        return cls(mine, ranks)

    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        """Not used: parity is streamed by `replicate_stream` (no copies are kept)."""
        raise CheckpointingException("ParityReplicationStrategy keeps parity, not copies")

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        """Collective over the parity group: sends the segments of this rank's part, writes
        this rank's parity record (opened as `open_sink((iteration, rank, session, PARITY),
        nbytes)`). Returns no copies."""
        k = len(self.ranks)
        me = _dist.get_rank()
        idx = self.ranks.index(me)
        iteration, _, session = id_
        infos: List[Any] = [None] * k
        segs = image.segments()
        cuts = pm.message_cuts([int(x.size) for x in segs])
        mine = (tuple(id_), int(image.nbytes), checksum(image.tail), cuts)
        dist.all_gather_object(infos, mine, group=self.group)
        for rank, (other, *_) in zip(self.ranks, infos):
            if tuple(other) != (iteration, rank, session):
                raise CheckpointingException(
                    f"Parity group {self.ranks}: rank {rank} saves {other}, rank {me} {tuple(id_)}"
                )
        sizes = [int(n) for _, n, _, _ in infos]
        seg = segment_size(sizes, k)
        header = {
            "format": 1,
            "id": [iteration, me, session],
            "group": self.ranks,
            "segment": seg,
            "chunk": pm.PARITY_CHUNK,
            "sizes": sizes,
            "digests": [int(d) for _, _, d, _ in infos],
        }
        record_id = (iteration, me, session, PARITY)
        total = seg + trailer_size(header, seg, pm.PARITY_CHUNK)
        peers = [(i, r) for i, r in enumerate(self.ranks) if r != me]
        # what each peer sends: (its offset of my parity's segment, its size, its cuts)
        senders = [(assignment(idx, i, k) * seg, sizes[i], infos[i][3]) for i, _ in peers]
        with concurrent.futures.ThreadPoolExecutor(1, "dc-parity-recv") as pool:
            received = pool.submit(
                self._receive,
                peers,
                senders,
                seg,
                open_sink,
                record_id,
                total,
                header,  # type: ignore[arg-type]
            )
            try:
                self._send(peers, idx, k, seg, segs, (int(image.nbytes), cuts))
            finally:
                received.result()
        return []

    def _send(
        self,
        peers: List[Tuple[int, int]],
        idx: int,
        k: int,
        seg: int,
        segs: List[np.ndarray],
        layout: Tuple[int, List[int]],
    ) -> None:
        """Sends each peer the segment of this part its parity covers, chunk by chunk, each
        chunk as the messages `message_ranges` cuts it into (views of the part's memory
        where a message lies in one tensor; the padding past the part is not sent)."""
        nbytes, cuts = layout
        inflight: deque = deque()
        tags = [0] * len(peers)
        try:
            for lo in range(0, seg, pm.PARITY_CHUNK):
                n = min(pm.PARITY_CHUNK, seg - lo)
                works = []
                for p, (i, peer) in enumerate(peers):
                    start = assignment(i, idx, k) * seg + lo
                    for a, b in pm.message_ranges(cuts, nbytes, start, start + n):
                        msg = padded_range(segs, a, b)
                        work = dist.isend(
                            torch.from_numpy(msg), dst=peer, group=self.group, tag=tags[p]
                        )
                        works.append((work, msg))
                        tags[p] += 1
                inflight.append(works)
                while len(inflight) > WINDOW:
                    wait_all([w for w, _ in inflight.popleft()])
        finally:
            wait_all([w for works in inflight for w, _ in works])

    def _receive(
        self,
        peers: List[Tuple[int, int]],
        senders: List[Tuple[int, int, List[int]]],
        seg: int,
        open_sink: OpenSink,
        record_id: Tuple[Any, ...],
        total: int,
        header: Dict[str, Any],
    ) -> None:
        """XORs the peers' segments chunk by chunk into this rank's parity record; a failed
        write keeps draining (the peers' sends must complete), then raises."""
        error: Optional[BaseException] = None
        sink: Any = None
        try:
            sink = open_sink(record_id, total)
        except Exception as e:
            error = e
        starts = list(range(0, seg, pm.PARITY_CHUNK))
        slots = min(WINDOW, len(starts))
        bufs = _buffers(slots * len(peers) + 1)
        acc = bufs.pop()
        sums: List[int] = []
        tags = [0] * len(peers)

        def post(c: int) -> List[Any]:
            n = min(pm.PARITY_CHUNK, seg - starts[c])
            works = []
            for p, (_, peer) in enumerate(peers):
                buf = bufs[(c % slots) * len(peers) + p]
                offset, nbytes, cuts = senders[p]
                lo = offset + starts[c]
                for a, b in pm.message_ranges(cuts, nbytes, lo, lo + n):
                    into = torch.from_numpy(buf[a - lo : b - lo])
                    works.append(dist.irecv(into, src=peer, group=self.group, tag=tags[p]))
                    tags[p] += 1
                buf[max(0, min(n, nbytes - lo)) : n] = 0  # past the sender's part: padding
            return works

        pending = deque(post(c) for c in range(slots))
        try:
            for c, lo in enumerate(starts):
                wait_all(pending.popleft())
                n = min(pm.PARITY_CHUNK, seg - lo)
                got = bufs[(c % slots) * len(peers) : (c % slots + 1) * len(peers)]
                out = got[0][:n]
                if len(got) > 1:
                    out = acc[:n]
                    pm.xor_of(out, got[0][:n], got[1][:n])
                    for more in got[2:]:
                        xor_into(out, more[:n])
                    if c + slots < len(starts):  # this slot's buffers are free again
                        pending.append(post(c + slots))
                sums.append(checksum(out))
                if error is None:
                    try:
                        sink.write(out, lo)
                    except Exception as e:  # keep draining
                        error = e
                if len(got) == 1 and c + slots < len(starts):  # written from its buffer
                    pending.append(post(c + slots))
            if error is None:
                sink.write(record_trailer(header, sums, seg), seg)
                sink.close()
                sink = None
        finally:
            if sink is not None:
                sink.abort()
            _give_back([*bufs, acc])
        if error is not None:
            raise error
