"""Who saves or loads each replicated shard within a group, and moving shards between ranks.

Shared by `strategies.fully_parallel` and `tensor_aware_state_dict`: of the ranks holding
a shard, one does the I/O (`distribute_shards_to_ranks`, pure; `compute_distribution`,
collective) and `exchange_shards` sends it to the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _dist
from ._types import ShardedStateDict
from .dict_utils import nested_values
from .errors import CheckpointingException
from .mapping import ShardedTensor, is_main_replica

__all__ = [
    "ShardId",
    "ShardDistribution",
    "shard_id",
    "group_ranks",
    "distribute_shards_to_ranks",
    "compute_distribution",
    "exchange_shards",
    "IN_FLIGHT_BYTES",
    "distribute",
    "without_data",
]

logger = logging.getLogger(__name__)

#: Bytes a rank posts to the shard exchange before waiting: bounds host copies in flight.
IN_FLIGHT_BYTES = 1 << 30
#: A shard of a global tensor: `(key, global_offset)`.
ShardId = Tuple[str, Tuple[int, ...]]


def shard_id(sh: ShardedTensor) -> ShardId:
    """The id of a ShardedTensor's shard: the same on every rank holding a replica."""
    return sh.key, tuple(int(o) for o in sh.global_offset)


def group_ranks(group: Optional[dist.ProcessGroup]) -> Tuple[int, ...]:
    """Global ranks of `group` (the whole world for None; `(0,)` without a process group)."""
    if not _dist.is_distributed():
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class ShardDistribution:
    """`saver`: shard id -> global rank that saves (or loads) it, within `group` (global
    ranks of the parallelization group)."""

    saver: Dict[ShardId, int]
    group: Tuple[int, ...]


def distribute_shards_to_ranks(
    holders: Mapping[ShardId, Sequence[int]], sizes: Mapping[ShardId, int], ranks: Iterable[int]
) -> Dict[ShardId, int]:
    """Assigns each shard to one of its holders, balancing bytes: largest shards first (ties
    by id), each to the holder with the fewest bytes so far (lowest rank on ties).

    `ranks` lists every rank of the group (each holder among them). Returns shard -> rank.
    """
    load = {rank: 0 for rank in ranks}
    saver: Dict[ShardId, int] = {}
    for sid in sorted(holders, key=lambda s: (-sizes[s], s)):
        rank = min(holders[sid], key=lambda r: (load[r], r))
        saver[sid] = rank
        load[rank] += sizes[sid]
    return saver


def distribute(holdings: List[Tuple[int, Dict[ShardId, int]]]) -> Dict[ShardId, int]:
    """`distribute_shards_to_ranks` for `[(rank, {shard: bytes held})]` per rank."""
    holders: Dict[ShardId, List[int]] = {}
    sizes: Dict[ShardId, int] = {}
    for rank, shards in holdings:
        for sid, nbytes in shards.items():
            holders.setdefault(sid, []).append(rank)
            sizes[sid] = max(sizes.get(sid, 0), nbytes)
    return distribute_shards_to_ranks(holders, sizes, [rank for rank, _ in holdings])


def without_data(sh: ShardedTensor) -> ShardedTensor:
    """`sh.without_data()`, typed as a ShardedTensor."""
    out = sh.without_data()
    assert isinstance(out, ShardedTensor)
    return out


def compute_distribution(
    sharded: ShardedStateDict, group: Optional[dist.ProcessGroup], only_main_replicas: bool = False
) -> ShardDistribution:
    """Collective over all ranks (each passing its own group, None: all ranks): the
    byte-balanced distribution of the ShardedTensors with data, the same on the group's ranks.
    `only_main_replicas`: only shards whose main replica is in the group (a save).

    Raises:
        CheckpointingException: ranks of the group disagree on its membership.
    """
    ranks = group_ranks(group)
    mine = {
        shard_id(sh): (sh.data.numel() * sh.data.element_size(), is_main_replica(sh.replica_id))
        for sh in nested_values(sharded)
        if isinstance(sh, ShardedTensor) and sh.data is not None
    }
    everyone = _dist.all_gather_object((ranks, mine))
    for r in ranks:
        if everyone[r][0] != ranks:
            raise CheckpointingException(
                f"Rank {_dist.get_rank()} and rank {r} disagree on the parallelization group: "
                f"{ranks} vs {everyone[r][0]}"
            )
    has_main = {sid for r in ranks for sid, (_, main) in everyone[r][1].items() if main}
    holdings = [
        (
            r,
            {
                s: n
                for s, (n, _) in everyone[r][1].items()
                if not only_main_replicas or s in has_main
            },
        )
        for r in ranks
    ]
    return ShardDistribution(distribute(holdings), ranks)


def exchange_shards(
    tensors: Dict[ShardId, Optional[torch.Tensor]], wanted: List[ShardedTensor]
) -> int:
    """Collective: fetches into `tensors` the wanted shards this rank lacks.

    Each shard comes from the lowest rank holding it, as a host tensor over the library's
    gloo group. All ranks post non-blocking sends and receives in one global order (shard
    id, then receiver), so buffers match messages and the earliest unfinished transfer
    always has both ends posted (no deadlock); they wait every `IN_FLIGHT_BYTES`.

    `tensors` maps shard ids to the tensors held here (None: lacks); a wanted shard arrives
    in the first wanted ShardedTensor's `data` when it can, else on its `data` device.
    Returns the bytes this rank sent; raises `CheckpointingException` if no rank holds one.
    """
    me = _dist.get_rank()
    need = sorted({shard_id(sh) for sh in wanted if tensors.get(shard_id(sh)) is None})
    devices = {
        shard_id(sh): sh.data.device if sh.data is not None else torch.device("cpu")
        for sh in wanted
    }
    # the first destination tensor of each wanted shard: received into directly when it can
    into: Dict[ShardId, torch.Tensor] = {}
    for sh in wanted:
        if sh.data is not None:
            into.setdefault(shard_id(sh), sh.data)
    have = {sid: (tuple(t.shape), t.dtype) for sid, t in tensors.items() if t is not None}
    everyone = _dist.all_gather_object((have, need))
    source: Dict[ShardId, int] = {}
    for rank, (held, _) in enumerate(everyone):
        for sid in sorted(held):
            source.setdefault(sid, rank)
    lacking = sorted({sid for _, needed in everyone for sid in needed if sid not in source})
    if lacking:
        raise CheckpointingException(
            f"No rank holds shard(s) {lacking[:8]} requested by "
            f"rank(s) {sorted(r for r, (_, n) in enumerate(everyone) if set(n) & set(lacking))}"
        )
    transfers = sorted((sid, rank) for rank, (_, needed) in enumerate(everyone) for sid in needed)
    group = _dist._group(None)
    moved = 0
    host: Dict[ShardId, torch.Tensor] = {}  # one host copy per sent shard, for every receiver
    received: Dict[ShardId, torch.Tensor] = {}
    pending: List[dist.Work] = []
    in_flight = 0

    def finish_window() -> None:
        with _dist._collective("shard exchange"):
            for work in pending:
                work.wait()
        for rid, buf in received.items():
            tensors[rid] = buf.to(devices[rid])
        pending.clear()
        received.clear()
        host.clear()

    for sid, dst in transfers:
        src = source[sid]
        if me == src:
            if sid not in host:
                t = tensors[sid]
                assert t is not None
                host[sid] = t.detach().to("cpu").contiguous()
            with _dist._collective("shard exchange"):
                pending.append(_posted(dist.isend(host[sid], dst=dst, group=group)))
            nbytes = host[sid].numel() * host[sid].element_size()
            moved += nbytes
        elif me == dst:
            shape, dtype = everyone[src][0][sid]
            received[sid] = _receive_buffer(into.get(sid), shape, dtype)
            with _dist._collective("shard exchange"):
                pending.append(_posted(dist.irecv(received[sid], src=src, group=group)))
            nbytes = received[sid].numel() * received[sid].element_size()
        else:
            continue
        in_flight += nbytes
        if in_flight >= IN_FLIGHT_BYTES:
            finish_window()
            in_flight = 0
    finish_window()
    if moved:
        logger.debug("rank %d sent %d bytes of shards", me, moved)
    return moved


def _receive_buffer(
    destination: Optional[torch.Tensor], shape: Tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`destination` itself if it is a contiguous CPU tensor of the sent shape and dtype,
    else a new buffer."""
    if (
        destination is not None
        and destination.device.type == "cpu"
        and destination.is_contiguous()
        and tuple(destination.shape) == tuple(shape)
        and destination.dtype == dtype
    ):
        return destination.detach()
    return torch.empty(shape, dtype=dtype)


def _posted(work: Optional[dist.Work]) -> dist.Work:
    """A point-to-point handle (None only for ranks outside the group, never here)."""
    assert work is not None
    return work
