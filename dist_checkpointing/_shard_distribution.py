"""Fully parallel local checkpoints of sharded state dicts: who stores each shard, and the
exchange that brings every rank the shards it asks for (used by `tensor_aware_state_dict`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _dist
from ._types import ShardedStateDict
from .dict_utils import nested_values
from .errors import CheckpointingException
from .mapping import ShardedTensor

__all__ = [
    "ShardDistribution",
    "ShardId",
    "compute_distribution",
    "distribute",
    "exchange",
    "group_ranks",
    "shard_id",
    "without_data",
]

logger = logging.getLogger(__name__)

ShardId = Tuple[str, Tuple[int, ...]]


def shard_id(sh: ShardedTensor) -> ShardId:
    """A shard's identity: `(key, global_offset)`."""
    return sh.key, tuple(int(o) for o in sh.global_offset)


def group_ranks(group: Optional[dist.ProcessGroup]) -> Tuple[int, ...]:
    """Global ranks of `group` (the whole world for None)."""
    if not _dist.is_distributed():
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class ShardDistribution:
    """Which global rank stores each ShardedTensor shard under `algo="fully_parallel"`.

    Attributes:
        saver: shard id `(key, global_offset)` -> global rank that stores it.
        group: global ranks of the parallelization group it was computed for.
    """

    saver: Dict[ShardId, int]
    group: Tuple[int, ...]


def distribute(holdings: List[Tuple[int, Dict[ShardId, int]]]) -> Dict[ShardId, int]:
    """Assigns each shard to one of the ranks holding it, largest shards first, each to the
    holder with the fewest bytes assigned so far (lowest rank on ties). Deterministic."""
    holders: Dict[ShardId, List[int]] = {}
    sizes: Dict[ShardId, int] = {}
    for rank, shards in holdings:
        for sid, nbytes in shards.items():
            holders.setdefault(sid, []).append(rank)
            sizes[sid] = max(sizes.get(sid, 0), nbytes)
    load = {rank: 0 for rank, _ in holdings}
    saver: Dict[ShardId, int] = {}
    for sid in sorted(sizes, key=lambda s: (-sizes[s], s)):
        rank = min(holders[sid], key=lambda r: (load[r], r))
        saver[sid] = rank
        load[rank] += sizes[sid]
    return saver


def compute_distribution(
    sharded: ShardedStateDict, group: Optional[dist.ProcessGroup]
) -> ShardDistribution:
    """Collective over all ranks: every rank calls it (each with its own group)."""
    ranks = group_ranks(group)
    mine = {
        shard_id(sh): sh.data.numel() * sh.data.element_size()
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
    return ShardDistribution(distribute([(r, everyone[r][1]) for r in ranks]), ranks)


def without_data(sh: ShardedTensor) -> ShardedTensor:
    """`sh.without_data()`, typed as a ShardedTensor."""
    out = sh.without_data()
    assert isinstance(out, ShardedTensor)
    return out


def exchange(tensors: Dict[ShardId, Optional[torch.Tensor]], wanted: List[ShardedTensor]) -> None:
    """Collective: fetches into `tensors` the wanted shards this rank lacks.

    Every rank learns who holds and who wants what; then shards move in one global order
    (sorted by shard id, then receiver), each from the lowest rank holding it, over the
    library's gloo group as host tensors. Processing the same order on every rank cannot
    deadlock: the first unfinished transfer always has both of its ends waiting on it.
    """
    me = _dist.get_rank()
    need = sorted({shard_id(sh) for sh in wanted if tensors.get(shard_id(sh)) is None})
    devices = {
        shard_id(sh): sh.data.device if sh.data is not None else torch.device("cpu")
        for sh in wanted
    }
    have = {sid: (tuple(t.shape), t.dtype) for sid, t in tensors.items() if t is not None}
    everyone = _dist.all_gather_object((have, need))
    source: Dict[ShardId, int] = {}
    for rank, (held, _) in enumerate(everyone):
        for sid in sorted(held):
            source.setdefault(sid, rank)
    lacking = sorted({sid for _, needed in everyone for sid in needed if sid not in source})
    if lacking:
        raise CheckpointingException(
            f"No rank stored shard(s) {lacking[:8]} requested by "
            f"rank(s) {sorted(r for r, (_, n) in enumerate(everyone) if set(n) & set(lacking))}"
        )
    transfers = sorted((sid, rank) for rank, (_, needed) in enumerate(everyone) for sid in needed)
    group = _dist._group(None)
    moved = 0
    for sid, dst in transfers:
        src = source[sid]
        if me == src:
            t = tensors[sid]
            assert t is not None
            with _dist._collective("send"):
                dist.send(t.detach().to("cpu").contiguous(), dst=dst, group=group)
            moved += t.numel() * t.element_size()
        elif me == dst:
            shape, dtype = everyone[src][0][sid]
            buf = torch.empty(shape, dtype=dtype)
            with _dist._collective("recv"):
                dist.recv(buf, src=src, group=group)
            tensors[sid] = buf.to(devices[sid])
    if moved:
        logger.debug("rank %d sent %d bytes of local checkpoint shards", me, moved)
