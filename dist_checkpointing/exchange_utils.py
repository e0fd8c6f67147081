"""Who saves or loads each replicated shard within a group, and moving shards between ranks.

Shared by the fully parallel strategy wrappers (`strategies.fully_parallel`) and the local
checkpoint bridge (`tensor_aware_state_dict`): when several ranks of a group hold the same
shard (data parallel replicas), one of them does the I/O and the others receive it.

- `distribute_shards_to_ranks`: a pure, deterministic assignment of shards to holders that
  balances bytes (largest shards first, each to the least loaded holder).
- `compute_distribution`: collective; gathers who holds what and applies it.
- `exchange_shards`: collective; sends every rank the shards it wants and lacks, point to
  point, from a rank that has them.
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

#: A shard of a global tensor: `(key, global_offset)`.

#: Bytes a rank posts to the shard exchange before waiting for them to arrive: bounds the
#: host copies of CUDA shards in flight (CPU shards arrive in the buffers they are kept in).
IN_FLIGHT_BYTES = 1 << 30
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
    """Which global rank does the I/O for each ShardedTensor shard of a group.

    Attributes:
        saver: shard id `(key, global_offset)` -> global rank that saves (or loads) it.
        group: global ranks of the parallelization group it was computed for.
    """

    saver: Dict[ShardId, int]
    group: Tuple[int, ...]


def distribute_shards_to_ranks(
    holders: Mapping[ShardId, Sequence[int]], sizes: Mapping[ShardId, int], ranks: Iterable[int]
) -> Dict[ShardId, int]:
    """Assigns each shard to one of its holders, balancing bytes. Pure and deterministic.

    Largest shards first (ties by shard id), each to the holder with the fewest bytes
    assigned so far (lowest rank on ties).

    Args:
        holders: shard -> ranks that hold it (each must be in `ranks`).
        sizes: shard -> bytes.
        ranks: every rank of the group (ranks holding nothing still count as empty).

    Returns:
        shard -> the rank that does its I/O.
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
    sharded: ShardedStateDict,
    group: Optional[dist.ProcessGroup],
    only_main_replicas: bool = False,
) -> ShardDistribution:
    """Collective over all ranks (each passing its own group): the byte-balanced distribution.

    Args:
        sharded: this rank's sharded state dict; ShardedTensors with data count as held.
        group: the parallelization group (None: all ranks).
        only_main_replicas: distribute only shards whose main replica is held within the
            group (a save: shards whose main replica lives in another group are that
            group's to write).

    Returns:
        The distribution, identical on every rank of the group.

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
    holders: Dict[ShardId, List[int]] = {}
    sizes: Dict[ShardId, int] = {}
    has_main: Dict[ShardId, bool] = {}
    for r in ranks:
        for sid, (nbytes, main) in everyone[r][1].items():
            holders.setdefault(sid, []).append(r)
            sizes[sid] = max(sizes.get(sid, 0), nbytes)
            has_main[sid] = has_main.get(sid, False) or main
    if only_main_replicas:
        holders = {sid: h for sid, h in holders.items() if has_main[sid]}
    return ShardDistribution(distribute_shards_to_ranks(holders, sizes, ranks), ranks)


def exchange_shards(
    tensors: Dict[ShardId, Optional[torch.Tensor]], wanted: List[ShardedTensor]
) -> int:
    """Collective: fetches into `tensors` the wanted shards this rank lacks.

    Every rank learns who holds and who wants what; then every rank posts its sends and
    receives without blocking (so transfers between different pairs of ranks run
    concurrently), waiting for them whenever `IN_FLIGHT_BYTES` are posted (which bounds
    the host copies of CUDA shards) and at the end. Each shard comes from the lowest rank
    holding it, over the library's gloo group as a host tensor (a CUDA tensor is copied to
    the host once, however many ranks receive it, and arrives back on the receiver's
    device). Both ends of a pair post their messages in the same global order (sorted by
    shard id, then receiver), which is how the receiver's buffers match the sender's
    messages. No deadlock: a rank waits only on transfers it posted, all earlier in that
    order than any it has not posted, so the earliest unfinished transfer always has both
    ends posted (or about to post) it.

    Args:
        tensors: shard id -> tensor this rank holds (None: lacks); filled in place.
        wanted: the ShardedTensors this rank needs; a received shard arrives in the
            first one's `data` when that is a contiguous CPU tensor of the sent shape and
            dtype, else in a new tensor on its `data` device (CPU when it has none).

    Returns:
        Bytes this rank sent.

    Raises:
        CheckpointingException: a wanted shard is held by no rank (naming it and who asked).
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
    """`destination` itself when the shard can arrive in it (a contiguous CPU tensor of the
    sender's shape and dtype: saves copying every received byte again), else a new buffer."""
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
    """A point-to-point operation's handle (torch types it Optional; it is None only for
    ranks outside the group, which never post here)."""
    assert work is not None
    return work
