"""Who saves or loads each replicated shard within a group, and moving shards between ranks.

Shared by `strategies.fully_parallel` and `tensor_aware_state_dict`: of the ranks holding
a shard, one does the I/O (`compute_distribution`, collective) and `exchange_shards` sends
it to the others.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _dist, coordination
from ._types import ShardedStateDict
from .coordination import AllToAll, Protocol, digest, fail_together, owner
from .dict_utils import nested_values
from .errors import CheckpointingException
from .mapping import ShardedTensor, is_main_replica

__all__ = [
    "ShardId",
    "ShardDistribution",
    "shard_id",
    "group_ranks",
    "shard_sizes",
    "compute_distribution",
    "distribution_protocol",
    "exchange_plan_protocol",
    "exchange_shards",
    "IN_FLIGHT_BYTES",
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


def _balance(sizes: Mapping[ShardId, int], ranks: Sequence[int]) -> Dict[ShardId, int]:
    """Assigns shards held by every one of `ranks` to one of them, balancing bytes: largest
    shards first (ties by id), each to the least loaded rank (lowest on ties)."""
    heap = [(0, rank) for rank in sorted(ranks)]
    saver: Dict[ShardId, int] = {}
    for sid in sorted(sizes, key=lambda s: (-sizes[s], s)):
        load, rank = heapq.heappop(heap)
        saver[sid] = rank
        heapq.heappush(heap, (load + sizes[sid], rank))
    return saver


def shard_sizes(sharded: ShardedStateDict) -> Dict[ShardId, Tuple[int, bool]]:
    """What `compute_distribution` balances: for each ShardedTensor with data, shard id ->
    (bytes, whether this rank holds its main replica)."""
    return {
        shard_id(sh): (sh.data.numel() * sh.data.element_size(), is_main_replica(sh.replica_id))
        for sh in nested_values(sharded)
        if isinstance(sh, ShardedTensor) and sh.data is not None
    }


def compute_distribution(
    sharded: ShardedStateDict, group: Optional[dist.ProcessGroup], only_main_replicas: bool = False
) -> ShardDistribution:
    """Collective over all ranks (each passing its own group, None: all ranks): the
    byte-balanced distribution of this rank's ShardedTensors with data, the same on every
    rank holding a shard (`distribution_protocol`). `only_main_replicas`: only shards whose
    main replica is in the group (a save).

    Raises:
        CheckpointingException: ranks of the group disagree on its membership.
    """
    ranks = group_ranks(group)
    mine = shard_sizes(sharded)
    protocol = distribution_protocol(_dist.get_rank(), ranks, mine, only_main_replicas)
    return ShardDistribution(coordination.run(protocol), ranks)


def _fail_together(
    problems: List[str], what: str, lanes: Tuple[int, ...] = ()
) -> Protocol[Tuple[int, ...]]:
    """`fail_together` raising `CheckpointingException("<what>: <problems> (<n> in all)")`."""

    def message(lines: List[str], count: int) -> str:
        return f"{what}: {'; '.join(lines)} ({count} in all)"

    return fail_together(problems, message, CheckpointingException, lanes=lanes, sent=4)


def distribution_protocol(
    rank: int,
    group: Sequence[int],
    shards: Mapping[ShardId, Tuple[int, bool]],
    only_main_replicas: bool = False,
) -> Protocol[Dict[ShardId, int]]:
    """One rank's side of `compute_distribution` (a `coordination` protocol).

    1. Every rank sends its group's lowest rank (the leader) a digest of the group, a digest
       of its shards and sizes, and the shards whose main replica it holds. Leaders check
       that each member and only members sent the same group; the failures and the groups
       whose members hold different shards are summed.
    2. Every member of a group holds the same shards (the usual case): the leader returns the
       shards with a main replica in the group and each rank balances its own shards over
       the group: the same inputs on every member, so the same result.
    3. Otherwise each shard's record goes to an owner in the group (a hash of its id), which
       returns its holders; a rank balances each set of shards with the same holders over
       those holders, all of whom hold all of them.

    No rank receives data proportional to world x shards.

    Args:
        rank: this rank. group: the global ranks sharing the work (sorted, with `rank`).
        shards: shard id -> (bytes, whether this rank holds its main replica).
        only_main_replicas: leave out shards whose main replica is not in the group.

    Returns:
        shard id -> the rank that saves (or loads) it, for this rank's shards.
    """
    group = tuple(sorted(group))
    leader, gdigest = group[0], digest(group)
    sizes = sorted((sid, n) for sid, (n, _) in shards.items())
    mains = sorted(sid for sid, (_, main) in shards.items() if main)
    received = yield AllToAll({leader: coordination.dumps((gdigest, digest(sizes), mains))})
    problems: List[str] = []
    uniform, has_main = 1, []
    if rank == leader:
        members = {src: coordination.loads(msg) for src, msg in received.items()}
        wrong = sorted(src for src, m in members.items() if m[0] != gdigest)
        missing = sorted(set(group) - set(members))
        if wrong or missing:
            problems.append(
                f"ranks {_dist.rank_ranges(wrong + missing)} disagree with rank {rank} on "
                f"the parallelization group {_dist.rank_ranges(group)}"
            )
        uniform = int(len({m[1] for m in members.values()}) == 1)
        has_main = sorted({sid for m in members.values() for sid in m[2]})
    (split,) = yield from _fail_together(
        problems, "fully parallel shard distribution", (int(not uniform),)
    )
    if not split:
        reply = coordination.dumps(has_main)
        got = yield AllToAll({r: reply for r in group} if rank == leader else {})
        main_here = set(coordination.loads(got[leader]))
        keep = {sid: n for sid, n in sizes if not only_main_replicas or sid in main_here}
        return _balance(keep, group)
    out: Dict[int, List[Any]] = defaultdict(list)
    for sid, (n, main) in shards.items():
        out[owner(repr(sid), group)].append((sid, n, main))
    received = yield AllToAll({d: coordination.dumps(m) for d, m in out.items()})
    holders: Dict[ShardId, List[Tuple[int, int, bool]]] = defaultdict(list)
    for src, msg in received.items():
        for sid, n, main in coordination.loads(msg):
            holders[tuple(sid)].append((src, n, main))  # type: ignore[arg-type]
    replies: Dict[int, Dict[Tuple[int, ...], List[Any]]] = defaultdict(lambda: defaultdict(list))
    for sid, held in holders.items():
        ranks = tuple(sorted(r for r, _, _ in held))
        entry = (sid, max(n for _, n, _ in held), any(m for _, _, m in held))
        for r in ranks:
            replies[r][ranks].append(entry)
    got = yield AllToAll({r: coordination.dumps(dict(by)) for r, by in replies.items()})
    by_holders: Dict[Tuple[int, ...], Dict[ShardId, int]] = defaultdict(dict)
    for msg in got.values():  # a set of holders' shards come from several owners
        for ranks, entries in coordination.loads(msg).items():
            for s, n, main in entries:
                if main or not only_main_replicas:
                    by_holders[ranks][tuple(s)] = n  # type: ignore[index]
    saver: Dict[ShardId, int] = {}
    for ranks, keep in by_holders.items():
        saver.update(_balance(keep, ranks))
    return saver


def exchange_plan_protocol(
    rank: int,
    world: int,
    have: Mapping[ShardId, Tuple[Tuple[int, ...], str]],
    need: Sequence[ShardId],
) -> Protocol[List[Tuple[ShardId, int, int, Any]]]:
    """One rank's side of planning `exchange_shards` (a `coordination` protocol): what each
    shard's owner (a hash of its id) learns of its holders and of the ranks needing it.

    Args:
        have: the shards held here -> (shape, dtype name). need: the shards wanted here.

    Returns:
        This rank's transfers `(shard, source, destination, (shape, dtype name))` in the
        order every rank uses (shard id, then destination).

    Raises:
        CheckpointingException: on every rank, when no rank holds a needed shard.
    """
    out: Dict[int, List[Any]] = defaultdict(list)
    for sid, meta in [*have.items(), *((sid, None) for sid in need)]:  # None: needed here
        out[owner(repr(sid), range(world))].append((sid, meta))
    received = yield AllToAll({d: coordination.dumps(m) for d, m in out.items()})
    source: Dict[ShardId, Tuple[int, Any]] = {}
    wanted: Dict[ShardId, List[int]] = defaultdict(list)
    for src in sorted(received):
        for sid, meta in coordination.loads(received[src]):
            if meta is None:
                wanted[tuple(sid)].append(src)  # type: ignore[arg-type]
            else:
                source.setdefault(tuple(sid), (src, meta))  # type: ignore[arg-type]
    lacking = sorted(sid for sid in wanted if sid not in source)
    problems = [f"no rank holds shard {sid} requested by rank(s) {wanted[sid]}" for sid in lacking]
    yield from _fail_together(problems, "shard exchange")
    replies: Dict[int, List[Any]] = defaultdict(list)
    for sid, dsts in wanted.items():
        src, meta = source[sid]
        for dst in dsts:
            for rank in {src, dst}:
                replies[rank].append((sid, src, dst, meta))
    got = yield AllToAll({d: coordination.dumps(m) for d, m in replies.items()})
    mine = {
        (tuple(s), src, dst, tuple(meta))
        for msg in got.values()
        for s, src, dst, meta in coordination.loads(msg)
    }
    return sorted(mine, key=lambda t: (t[0], t[2]))  # type: ignore[return-value]


def exchange_shards(
    tensors: Dict[ShardId, Optional[torch.Tensor]], wanted: List[ShardedTensor]
) -> int:
    """Collective: fetches into `tensors` the wanted shards this rank lacks.

    Each shard comes from the lowest rank holding it, as a host tensor over the library's
    gloo group (`exchange_plan_protocol` finds the sources). Every rank posts its
    non-blocking sends and receives in one global order (shard id, then receiver), so each
    pair of ranks matches its messages in order and the earliest unfinished transfer always
    has both ends posted (no deadlock); they wait every `IN_FLIGHT_BYTES`.

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
    # each wanted shard's first destination (reversed: set last) is received into when it can
    into = {shard_id(sh): sh.data for sh in reversed(wanted) if sh.data is not None}
    have = {
        sid: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for sid, t in tensors.items()
        if t is not None
    }
    plan = coordination.run(exchange_plan_protocol(me, _dist.get_world_size(), have, need))
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

    for sid, src, dst, (shape, dtype) in plan:
        post: Callable[..., Any]
        if me == src:
            if sid not in host:
                t = tensors[sid]
                assert t is not None
                host[sid] = t.detach().to("cpu").contiguous()
            buf, post, peer = host[sid], dist.isend, dst
            moved += buf.numel() * buf.element_size()
        else:
            buf = received[sid] = _receive_buffer(into.get(sid), shape, getattr(torch, dtype))
            post, peer = dist.irecv, src
        with _dist._collective("shard exchange"):
            work = post(buf, peer, group=group)
        assert work is not None  # None only on ranks outside the group, never here
        pending.append(work)
        in_flight += buf.numel() * buf.element_size()
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
    """`destination` if it is a contiguous CPU tensor of this shape and dtype, else a new one."""
    if (
        destination is not None
        and destination.device.type == "cpu"
        and destination.is_contiguous()
        and tuple(destination.shape) == tuple(shape)
        and destination.dtype == dtype
    ):
        return destination.detach()
    return torch.empty(shape, dtype=dtype)
