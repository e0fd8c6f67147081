"""Replication strategies: where copies of each rank's local checkpoint part are kept.

Parts travel as byte images over gloo (host buffers even with NCCL training), never pickled.
At load any holder may send a part, so parts stay reachable when the replication changes.
`ParityReplicationStrategy` (module `parity`) keeps XOR parity instead of copies.
"""

from __future__ import annotations

import datetime
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException, NoReplicasAvailableError, describe_ckpt_id
from .._image import LocalImage
from ._stream import CHUNK, ImageSink, OpenSink, stream_exchange, wait_all

__all__ = [
    "CkptID",
    "NoReplicasAvailableError",
    "ExchangePlan",
    "ImageSink",
    "ReplicationStrategy",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "ParityReplicationStrategy",
    "clique_ranks",
    "plan_retrieval",
    "transfer_parts",
]

logger = logging.getLogger(__name__)

TRANSFER_CHUNK = 16 << 20
#: tags of one transfer's messages: transfer index * _TAG_SPAN + message index
_TAG_SPAN = 1 << 20

#: (iteration, owner rank, session id)
CkptID = Tuple[int, int, str]


def clique_ranks(
    world_size: int, replication_jump: int, replication_factor: int
) -> List[List[int]]:
    """The cliques `n, n+J, ..., n+(F-1)J` for `n = a*J*F + b`, `b < J`.

    Raises:
        CheckpointingException: non-positive parameters, or `world_size` not divisible by J*F.
    """
    for name, v in (
        ("replication_jump", replication_jump),
        ("replication_factor", replication_factor),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointingException(f"{name} must be a positive int, got {v!r}")
    span = replication_jump * replication_factor
    if world_size % span:
        raise CheckpointingException(
            f"World size {world_size} is not divisible by replication_jump * replication_factor "
            f"= {replication_jump} * {replication_factor} = {span}"
        )
    starts = [a * span + b for a in range(world_size // span) for b in range(replication_jump)]
    return [[n + i * replication_jump for i in range(replication_factor)] for n in starts]


def _post(op: Any, buf: torch.Tensor, peer: int, group: Any, chunk: int, tag: int = 0) -> List:
    """Posts `op` (`dist.isend`/`dist.irecv`) of `buf` in messages of `chunk` bytes."""
    size = int(buf.numel())
    return [
        op(buf[lo : lo + chunk], peer, group=group, tag=tag + k)
        for k, lo in enumerate(range(0, size, chunk))
    ]


@dataclass
class ExchangePlan:
    """Who sends which part to whom: `(sender, receiver, ckpt_id)`, in execution order."""

    transfers: List[Tuple[int, int, CkptID]] = field(default_factory=list)


def plan_retrieval(
    available: Mapping[int, Iterable[CkptID]], wanted: Mapping[int, Sequence[CkptID]]
) -> ExchangePlan:
    """Plans who provides each wanted part (pure): the receiver if it holds it, else the
    holder with the fewest sends so far, lowest rank first. NoReplicasAvailableError if none."""
    holders: Dict[CkptID, List[int]] = {}
    for rank in sorted(available):
        for id_ in available[rank]:
            holders.setdefault(tuple(id_), []).append(rank)  # type: ignore[arg-type]
    sends: Dict[int, int] = {}
    plan = ExchangePlan()
    for receiver in sorted(wanted):
        for id_ in wanted[receiver]:
            key = tuple(id_)
            candidates = holders.get(key, [])  # type: ignore[arg-type]
            if not candidates:
                raise NoReplicasAvailableError(
                    f"No rank holds a usable copy of the local checkpoint part ({describe_ckpt_id(key)}) "
                    f"needed by rank {receiver}"
                )
            sender = (
                receiver
                if receiver in candidates
                else min(candidates, key=lambda r: (sends.get(r, 0), r))
            )
            if sender != receiver:  # keeping one's own copy costs no network
                sends[sender] = sends.get(sender, 0) + 1
            plan.transfers.append((sender, receiver, key))  # type: ignore[arg-type]
    return plan


_host_group: Any = None


def host_group() -> Any:
    """Collective on first call: a gloo group over all ranks (None: the default group is gloo)."""
    global _host_group
    if not _dist.is_distributed() or dist.get_backend() == "gloo":
        return None
    if _host_group is None:
        _host_group = _dist.new_own_group(backend="gloo")
    return _host_group


def transfer_parts(
    plan: ExchangePlan, load: Callable[[CkptID], torch.Tensor], group: Any = None
) -> Tuple[Dict[CkptID, Tuple[int, torch.Tensor]], List[CkptID]]:
    """Collective over `group` (gloo, all ranks): runs the plan's transfers. Returns the parts
    received here, `id -> (sender, bytes)` (unverified), and those this rank could not `load`
    to send (announced with size -1)."""
    me = _dist.get_rank()
    mine: Dict[int, torch.Tensor] = {}
    sizes: Dict[int, int] = {}
    unsent: List[CkptID] = []
    for index, (sender, receiver, id_) in enumerate(plan.transfers):
        if sender == me != receiver:
            try:
                mine[index] = load(id_)
            except (CheckpointingException, OSError) as e:
                logger.warning("cannot read part %s to send it to rank %d: %s", id_, receiver, e)
                unsent.append(id_)
            sizes[index] = int(mine[index].numel()) if index in mine else -1
    for part in _dist.all_gather_object(sizes, group):
        sizes.update(part)
    received: Dict[CkptID, Tuple[int, torch.Tensor]] = {}
    works = []
    op: Any
    for index, (sender, receiver, id_) in enumerate(plan.transfers):
        if sender == receiver or sizes.get(index, -1) < 0 or me not in (sender, receiver):
            continue
        if sender == me:
            buf, op, peer = mine[index], dist.isend, receiver
        else:
            buf, op, peer = torch.empty(sizes[index], dtype=torch.uint8), dist.irecv, sender
            received[id_] = (sender, buf)
        works += _post(op, buf, peer, group, TRANSFER_CHUNK, index * _TAG_SPAN)
    wait_all(works)
    return received, unsent


class ReplicationStrategy(ABC):
    """Decides where copies of each rank's local checkpoint part go (the manager's contract).

    For every save, `BaseCheckpointManager.save` calls, on every rank: `prepare()` in the
    caller's thread (collective over all ranks; may create groups), then `replicate_stream`
    in the manager's background thread (collective over the ranks this rank exchanges with;
    by default through `replicate_images`). Loading does not call the strategy (see
    `plan_retrieval`). Copies are byte-identical.
    """

    def prepare(self) -> None:
        """Collective: builds what the strategy needs (process groups) in the caller thread."""
        return None

    @abstractmethod
    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        """Collective over this rank's exchange group: sends this rank's part, receives copies.

        Args:
            image: this rank's finished part (1-D uint8, host memory).
            id_: its id, `(iteration, owner rank, session id)`.

        Returns:
            The `(id, image)` copies kept here, its own part excluded.
        """

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        """Collective over this rank's exchange group: sends this rank's part, writes copies
        (`open_sink(id, nbytes)` opens where one goes).

        Returns:
            `(id, nbytes)` of each part written, this rank's own part excluded.
        """
        buffer = image.buffer
        if buffer is None:  # an unstaged image: one contiguous copy for `replicate_images`
            buffer = torch.from_numpy(np.concatenate(image.segments()))
        out = []
        for other, data in self.replicate_images(buffer, id_):
            nbytes = int(data.numel())
            sink = open_sink(other, nbytes)
            try:
                sink.write(data.numpy(), 0)
            except BaseException:
                sink.abort()
                raise
            sink.close()
            out.append((other, nbytes))
        return out


class CliqueReplicationStrategy(ReplicationStrategy):
    """Every member of this rank's clique keeps a copy of every member's part.

    Args:
        local_group: the process group of this rank's clique (gloo, or any group that can
            move tensors on `target_device`); None means all ranks form one clique.
        target_device: where exchange buffers live ('cpu' for gloo).
    """

    def __init__(self, local_group: Any, target_device: str = "cpu") -> None:
        self.local_group = local_group
        self.target_device = target_device
        self.ranks = list(range(_dist.get_world_size()))
        if _dist.is_distributed() and local_group is not None:
            self.ranks = dist.get_process_group_ranks(local_group)

    @classmethod
    def from_replication_params(
        cls,
        replication_jump: Optional[int] = None,
        replication_factor: int = 2,
        *,
        timeout: Optional[datetime.timedelta] = None,
    ) -> CliqueReplicationStrategy:
        """Collective: creates one gloo group per clique and returns this rank's strategy.

        Args:
            replication_jump: J, the distance between ranks of a clique (e.g. GPUs per node,
                so copies land on other nodes); default: the number of local CUDA devices,
                or 1 without CUDA.
            replication_factor: F, the number of copies of each part (clique size).
            timeout: how long a background exchange waits for a missing peer before failing
                (default: the process group default).

        Raises:
            CheckpointingException: on every rank, if the world size is not divisible by J*F.
        """
        jump = max(1, torch.cuda.device_count()) if replication_jump is None else replication_jump
        cliques = clique_ranks(_dist.get_world_size(), jump, replication_factor)
        me = _dist.get_rank()
        mine: Any = None
        for ranks in cliques:  # every rank creates every group (timeout=None: the default)
            if _dist.is_distributed():
                group = _dist.new_own_group(ranks, backend="gloo", timeout=timeout)
                mine = group if me in ranks else mine
        logger.debug("replication cliques %s (rank %d)", cliques, me)
        return cls(mine)

    def _clique(self) -> List[int]:
        return self.ranks

    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        """Collective over the clique: sends this rank's image to every other member."""
        if len(self._clique()) == 1:
            return []
        me = _dist.get_rank()
        infos: List[Any] = [None] * len(self.ranks)
        dist.all_gather_object(infos, (tuple(id_), int(image.numel())), group=self.local_group)
        # every send and receive posted at once, in large chunks: nothing waits per chunk
        mine = image.to(self.target_device)
        works, out = [], []
        for peer, (other_id, nbytes) in zip(self.ranks, infos):
            if peer == me:
                continue
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.target_device)
            works += _post(dist.irecv, buf, peer, self.local_group, CHUNK)
            works += _post(dist.isend, mine, peer, self.local_group, CHUNK)
            out.append((tuple(other_id), buf))
        wait_all(works)
        return [(i, b.cpu()) for i, b in out]  # type: ignore[misc]

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        """Collective over the clique: streams this rank's part to every other member, writing
        theirs chunk by chunk as they arrive."""
        if len(self._clique()) == 1:
            return []
        if self.target_device != "cpu":  # exchange buffers on a device: whole images
            return super().replicate_stream(image, id_, open_sink)
        return stream_exchange(self.local_group, self.ranks, id_, image.segments(), open_sink)


class LazyCliqueReplicationStrategy(CliqueReplicationStrategy):
    """A `CliqueReplicationStrategy` whose groups are created in `prepare`, for code that
    must construct the strategy before `torch.distributed` is initialized."""

    def __init__(
        self,
        replication_jump: Optional[int] = None,
        replication_factor: int = 2,
        *,
        timeout: Optional[datetime.timedelta] = None,
    ) -> None:
        self.replication_jump = replication_jump
        self.replication_factor = replication_factor
        self.timeout = timeout
        self._built: Optional[CliqueReplicationStrategy] = None

    def prepare(self) -> None:
        if self._built is None:
            built = CliqueReplicationStrategy.from_replication_params(
                self.replication_jump, self.replication_factor, timeout=self.timeout
            )
            super().__init__(built.local_group, built.target_device)
            self._built = built

    def _clique(self) -> List[int]:
        if self._built is None:
            raise CheckpointingException(
                "LazyCliqueReplicationStrategy.prepare() must run (collectively) before a background exchange"
            )
        return self.ranks


# defined in its own module (it builds on the classes above); public under this path too
from .parity import ParityReplicationStrategy  # noqa: E402
