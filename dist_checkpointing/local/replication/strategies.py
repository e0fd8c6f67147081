"""Replication strategies: where copies of each rank's local checkpoint part are kept.

`CliqueReplicationStrategy` splits the ranks into cliques of `replication_factor` ranks,
`replication_jump` apart, and gives every member of a clique a copy of every other member's
part. Parts travel as byte images (see `.._image`): raw tensor bytes sent over a gloo
process group, never pickled tensors, straight from the memory they live in and written to
the receiver's file as they arrive (`._stream`). Copies are byte-identical, checksums
included.

Retrieval (at load) is planned from what every rank holds, identically on every rank, so a
missing part raises `NoReplicasAvailableError` on every rank rather than hanging one. Any
holder in the world may send a part (not only clique members), so a part stays reachable
after replication parameters change between runs.

Why gloo on host buffers even with NCCL training: the bytes are in host memory anyway (they
are written to local disk from there), and exchanging them over gloo keeps GPU memory and
NCCL streams out of a background exchange.
"""

from __future__ import annotations

import datetime
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException, NoReplicasAvailableError, describe_ckpt_id
from .._image import LocalImage
from ._stream import ImageSink, OpenSink, stream_exchange

__all__ = [
    "CkptID",
    "NoReplicasAvailableError",
    "ExchangePlan",
    "ImageSink",
    "ReplicationStrategy",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "clique_ranks",
    "plan_retrieval",
    "execute_plan",
]

logger = logging.getLogger(__name__)

#: bytes per message of the replication exchange
_CHUNK = 64 << 20

#: (iteration, owner rank, session id)
CkptID = Tuple[int, int, str]


def describe_id(ckpt_id: Any) -> str:
    """'iteration I, rank R' for a checkpoint id (for messages)."""
    return describe_ckpt_id(ckpt_id)


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
    cliques = []
    for a in range(world_size // span):
        for b in range(replication_jump):
            n = a * span + b
            cliques.append([n + i * replication_jump for i in range(replication_factor)])
    return cliques


@dataclass
class ExchangePlan:
    """Who sends which part to whom: `(sender, receiver, ckpt_id)`, in execution order."""

    transfers: List[Tuple[int, int, CkptID]] = field(default_factory=list)

    def plan(self, sender: int, receiver: int, id_: CkptID) -> None:
        self.transfers.append((sender, receiver, id_))

    def required_ids(self, rank: Optional[int] = None) -> Set[CkptID]:
        """Parts that `rank` (default: this rank) must provide, for itself or for others."""
        rank = _dist.get_rank() if rank is None else rank
        return {id_ for s, _, id_ in self.transfers if s == rank}

    def received_ids(self, rank: Optional[int] = None) -> List[CkptID]:
        """Parts that `rank` (default: this rank) ends up with."""
        rank = _dist.get_rank() if rank is None else rank
        return [id_ for _, r, id_ in self.transfers if r == rank]


def plan_retrieval(
    available: Mapping[int, Iterable[CkptID]], wanted: Mapping[int, Sequence[CkptID]]
) -> ExchangePlan:
    """Plans who provides each wanted part (pure; every rank computes the same plan).

    A receiver that holds a part keeps it; otherwise the holder with the fewest sends so
    far sends it (lowest rank on ties).

    Args:
        available: rank -> parts it holds.
        wanted: receiver rank -> parts it needs.

    Raises:
        NoReplicasAvailableError: a wanted part is held by no rank (names it and the receiver).
    """
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
                    f"No rank holds a usable copy of the local checkpoint part ({describe_id(key)}) "
                    f"needed by rank {receiver}"
                )
            sender = (
                receiver
                if receiver in candidates
                else min(candidates, key=lambda r: (sends.get(r, 0), r))
            )
            if sender != receiver:  # keeping one's own copy costs no network
                sends[sender] = sends.get(sender, 0) + 1
            plan.plan(sender, receiver, key)  # type: ignore[arg-type]
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


def execute_plan(
    plan: ExchangePlan, my_data: Mapping[CkptID, torch.Tensor], group: Any = None
) -> Dict[CkptID, torch.Tensor]:
    """Collective over `group` (all ranks): moves byte images as `plan` says.

    Args:
        plan: the same plan on every rank.
        my_data: the images (uint8 CPU tensors) this rank provides: at least
            `plan.required_ids()`.
        group: a gloo group over all ranks (None: the default group).

    Returns:
        The images this rank receives (or keeps), by id.

    Raises:
        CheckpointingException: this rank lacks an image the plan asks it to send.
    """
    me = _dist.get_rank()
    missing = plan.required_ids(me) - set(my_data)
    if missing:
        raise CheckpointingException(
            f"Rank {me} was planned to provide {sorted(describe_id(m) for m in missing)} but does not hold them"
        )
    sizes: Dict[CkptID, int] = {}
    for part in _dist.all_gather_object(
        {id_: int(my_data[id_].numel()) for id_ in plan.required_ids(me)}, group
    ):
        sizes.update(part)
    received: Dict[CkptID, torch.Tensor] = {}
    works = []
    for tag, (sender, receiver, id_) in enumerate(plan.transfers):
        if sender == receiver:
            if sender == me:
                received[id_] = my_data[id_]
        elif sender == me:
            works.append(dist.isend(my_data[id_].contiguous(), dst=receiver, group=group, tag=tag))
        elif receiver == me:
            buf = torch.empty(sizes[id_], dtype=torch.uint8)
            works.append(dist.irecv(buf, src=sender, group=group, tag=tag))
            received[id_] = buf
    for w in works:
        if w is not None:
            w.wait()
    return received


class ReplicationStrategy(ABC):
    """Decides where copies of each rank's local checkpoint part go (the manager's contract).

    What `BaseCheckpointManager.save` calls, in this order, for every save:
    1. `prepare()`: on every rank, in the caller's thread, before any background work;
       collective over all ranks (it may create process groups).
    2. `replicate_stream(image, id_, open_sink)`: on every rank, in the manager's one
       background thread, after this rank's part is serialized and checksummed (while this
       rank's own part is being written); collective over the ranks this rank exchanges
       with (and only those, as other ranks may be at another point of their background
       work). It writes every part received into a sink the manager opens (a dirty file).
       The default implementation calls `replicate_images` (the one method a strategy must
       implement) and writes what it returns; strategies that can stream override it.

    Loading does not call the
    strategy: retrieval is planned from what every rank holds (`plan_retrieval`,
    `execute_plan`), so parts stay reachable after the replication parameters change.

    Invariant: the returned images are byte-identical to what their owners passed in
    (checksums included), so each copy verifies on its own.
    """

    def prepare(self) -> None:
        """Collective: builds what the strategy needs (process groups) in the caller thread.

        Strategies that build lazily must do it here, not in the background thread.
        """
        return None

    @abstractmethod
    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        """Collective over this rank's exchange group: sends this rank's part, receives copies.

        Args:
            image: this rank's finished part (a 1-D uint8 tensor in host memory).
            id_: its id, `(iteration, owner rank, session id)`.

        Returns:
            The `(id, image)` pairs this rank keeps a copy of, its own part excluded.
        """

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        """Collective over this rank's exchange group: sends this rank's part, writes copies.

        Args:
            image: this rank's finished part (staged in one buffer, or its tensors' memory).
            id_: its id.
            open_sink: `(id, nbytes) -> sink` opens where a received part is written.

        Returns:
            `(id, nbytes)` of each part written, this rank's own part excluded.

        Raises:
            What the exchange or the sinks raised.
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
        if _dist.is_distributed():
            self.ranks = (
                dist.get_process_group_ranks(local_group)
                if local_group is not None
                else list(range(dist.get_world_size()))
            )
        else:
            self.ranks = [0]

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
        if replication_jump is None:
            replication_jump = max(1, torch.cuda.device_count())
        world = _dist.get_world_size()
        cliques = clique_ranks(world, replication_jump, replication_factor)
        me = _dist.get_rank()
        mine: Any = None
        for ranks in cliques:
            kwargs: Dict[str, Any] = {"backend": "gloo"}
            if timeout is not None:
                kwargs["timeout"] = timeout
            group = _dist.new_own_group(ranks, **kwargs) if _dist.is_distributed() else None
            if me in ranks:
                mine = group
        logger.debug("replication cliques %s (rank %d)", cliques, me)
        return cls(mine)

    def _to_target(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.target_device == "cpu" else t.to(self.target_device)

    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        """Collective over the clique: sends this rank's image to every other member.

        Safe to run in a background thread (it uses only the clique group).

        Returns:
            The other members' `(id, image)` pairs.
        """
        if len(self.ranks) == 1:
            return []
        start = time.perf_counter()
        me = _dist.get_rank()
        infos: List[Any] = [None] * len(self.ranks)
        dist.all_gather_object(infos, (tuple(id_), int(image.numel())), group=self.local_group)
        # every send and receive is posted at once, in large chunks: both directions of
        # each pair run together and nothing waits per tensor or per chunk
        mine = self._to_target(image)
        works, out = [], []
        for peer, (other_id, nbytes) in zip(self.ranks, infos):
            if peer == me:
                continue
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.target_device)
            for k, lo in enumerate(range(0, nbytes, _CHUNK)):
                works.append(
                    dist.irecv(buf[lo : lo + _CHUNK], src=peer, group=self.local_group, tag=k)
                )
            for k, lo in enumerate(range(0, int(mine.numel()), _CHUNK)):
                works.append(
                    dist.isend(mine[lo : lo + _CHUNK], dst=peer, group=self.local_group, tag=k)
                )
            out.append((tuple(other_id), buf))
        for w in works:
            if w is not None:
                w.wait()
        out = [(i, b.cpu()) for i, b in out]
        received = sum(int(b.numel()) for _, b in out)
        elapsed = time.perf_counter() - start
        logger.info(
            "replicated %.1f MB to %d peers, received %.1f MB in %.2f s",
            image.numel() / 1e6,
            len(self.ranks) - 1,
            received / 1e6,
            elapsed,
        )
        return out  # type: ignore[return-value]

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        """Collective over the clique: streams this rank's part to every other member and
        writes theirs chunk by chunk as they arrive (see `._stream`).

        Safe to run in a background thread (it uses only the clique group).
        """
        if len(self.ranks) == 1:
            return []
        if self.target_device != "cpu":  # exchange buffers on a device: whole images
            return super().replicate_stream(image, id_, open_sink)
        start = time.perf_counter()
        out = stream_exchange(
            self.local_group, self.ranks, _dist.get_rank(), id_, image.segments(), open_sink
        )
        logger.info(
            "replicated %.1f MB to %d peers, received and wrote %.1f MB in %.2f s",
            image.nbytes / 1e6,
            len(self.ranks) - 1,
            sum(n for _, n in out) / 1e6,
            time.perf_counter() - start,
        )
        return out


class LazyCliqueReplicationStrategy(CliqueReplicationStrategy):
    """A `CliqueReplicationStrategy` whose groups are created on first use (in `prepare`).

    For code that must construct the strategy before `torch.distributed` is initialized.
    """

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
            self._built = CliqueReplicationStrategy.from_replication_params(
                self.replication_jump, self.replication_factor, timeout=self.timeout
            )
            self.local_group = self._built.local_group
            self.ranks = self._built.ranks
            self.target_device = self._built.target_device

    def replicate_images(
        self, image: torch.Tensor, id_: CkptID
    ) -> List[Tuple[CkptID, torch.Tensor]]:
        self._require_built()
        return super().replicate_images(image, id_)

    def replicate_stream(
        self, image: LocalImage, id_: CkptID, open_sink: OpenSink
    ) -> List[Tuple[CkptID, int]]:
        self._require_built()
        return super().replicate_stream(image, id_, open_sink)

    def _require_built(self) -> None:
        if self._built is None:
            raise CheckpointingException(
                "LazyCliqueReplicationStrategy.prepare() must run (collectively) before a background exchange"
            )
