"""The agreement that starts every save (and a validated load), as one `coordination` protocol.

1. One sum carries each rank's failure flag, four lanes of a digest of `(rank, its shard
   records)` (the sums identify the job's sharding), two lanes comparing the common state,
   and whether the rank's records changed since the last check that passed.
2. Any failure: the reports are gathered at rank 0 and broadcast; every rank raises.
3. Nothing changed anywhere: done. Otherwise each key's owner (a hash of the key) checks
   its `ShardRecord`s (`key_problems`, shared with `validation.find_sharding_problems`);
   any problems are gathered at rank 0, whose message every rank raises as
   `ShardingIntegrityError`. No rank receives data proportional to world x tensors.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _dist
from .coordination import (
    AllReduceSum,
    AllToAll,
    Broadcast,
    Gather,
    Protocol,
    digest,
    dumps,
    fail_together,
    loads,
    owner,
)
from .errors import CheckpointingException, ShardingIntegrityError
from .mapping import ShardedObject, ShardedTensor, is_main_replica

__all__ = [
    "Agreement",
    "AgreementCache",
    "ShardRecord",
    "agreement_protocol",
    "format_problems",
    "key_problems",
    "record_of",
]

#: problems a message shows at most
MAX_REPORTED = 20


class ShardRecord(NamedTuple):
    """What validation needs of one shard (metadata only; plain values, cheap to send).

    Field names follow `ShardedTensor`/`ShardedObject`, so the checks read either.
    """

    kind: str  # "t": a tensor shard, "o": an object
    key: str
    dtype: str  # "" for objects
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    prepended_local_shape: Tuple[int, ...]  # () for objects
    replica_id: int  # 0: the main replica

    @property
    def unique_key(self) -> str:
        """An object's key with its grid position (as `ShardedObject.unique_key`)."""
        loc = ".".join(map(str, self.global_offset))
        glob = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{loc}_{glob}"


def record_of(sh: Any) -> Optional[ShardRecord]:
    """The record of a `ShardedTensor` or `ShardedObject` (None for other leaves)."""
    if isinstance(sh, ShardedTensor):
        kind, dtype, local = "t", str(sh.dtype), tuple(sh.prepended_local_shape)
    elif isinstance(sh, ShardedObject):
        kind, dtype, local = "o", "", ()
    else:
        return None
    main = 0 if is_main_replica(sh.replica_id) else 1
    shape, offset = tuple(sh.global_shape), tuple(sh.global_offset)
    return ShardRecord(kind, sh.key, dtype, shape, offset, local, main)


def _first_overlap(starts: np.ndarray, ends: np.ndarray) -> Optional[Tuple[int, int]]:
    """One pair (i, j), i < j, of overlapping non-empty boxes, or None."""
    # a sweep along the axis with the most distinct starts compares a box only with the boxes
    # that start before it ends on that axis, not with every other box
    n, ndim = starts.shape
    nonempty = np.all(ends > starts, axis=1) if ndim else np.ones(n, dtype=bool)
    idx = np.nonzero(nonempty)[0]
    if len(idx) < 2:
        return None
    if ndim == 0:  # 0-d tensors: any two pieces are the same element
        return int(idx[0]), int(idx[1])
    axis = max(range(ndim), key=lambda d: len(np.unique(starts[idx, d])))
    order = idx[np.argsort(starts[idx, axis], kind="stable")]
    s, e = starts[order], ends[order]
    reach = np.searchsorted(s[:, axis], e[:, axis], side="left")
    for i in range(len(order)):
        if reach[i] <= i + 1:
            continue
        hit = np.nonzero(
            np.all((s[i + 1 : reach[i]] < e[i]) & (e[i + 1 : reach[i]] > s[i]), axis=1)
        )[0]
        if len(hit):
            a, b = int(order[i]), int(order[i + 1 + hit[0]])
            return min(a, b), max(a, b)
    return None


def _tensor_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    ref = shards[0][1]
    main = [(rank, sh) for rank, sh in shards if sh.replica_id == 0]
    if not main:
        return [
            f"Invalid access pattern for {key!r}: no rank holds a main replica (replica_id 0), "
            "so it would not be saved"
        ]
    dims = (len(main), len(ref.global_shape))
    starts = np.array([sh.global_offset for _, sh in main], dtype=np.int64).reshape(dims)
    sizes = np.array([sh.prepended_local_shape for _, sh in main], dtype=np.int64).reshape(dims)
    pair = _first_overlap(starts, starts + sizes)
    if pair is not None:
        (ra, a), (rb, b) = main[pair[0]], main[pair[1]]
        return [
            f"Invalid access pattern for {key!r}: main replicas overlap: rank {ra} offset "
            f"{a.global_offset} shape {a.prepended_local_shape} and rank {rb} offset "
            f"{b.global_offset} shape {b.prepended_local_shape}"
        ]
    covered = sum(math.prod(sh.prepended_local_shape) for _, sh in main)
    total = math.prod(ref.global_shape)
    if covered != total:
        return [
            f"Invalid access pattern for {key!r}: main replicas cover {covered} of {total} "
            f"elements of global shape {ref.global_shape} (a gap)"
        ]
    return []


def _object_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    ref = shards[0][1]
    seen: Dict[Tuple[int, ...], int] = {}
    for rank, sh in shards:
        if sh.replica_id != 0:
            continue
        if sh.global_offset in seen:
            return [
                f"Duplicate ShardedObject keys: [{sh.unique_key!r}] (ShardedObject {key!r}: "
                f"offset {sh.global_offset} has main replicas on ranks "
                f"{seen[sh.global_offset]} and {rank})"
            ]
        seen[sh.global_offset] = rank
    total = math.prod(ref.global_shape)
    if len(seen) != total:
        return [
            f"Invalid access pattern: {total - len(seen)} ShardedObject are missing "
            f"(ShardedObject {key!r}: main replicas cover {len(seen)} of {total} pieces of "
            f"grid {ref.global_shape}, a gap)"
        ]
    return []


def key_problems(key: str, shards: List[Tuple[int, ShardRecord]]) -> List[str]:
    """What is wrong with one key's shards from every rank (`(rank, record)`, rank order):
    a key used as both kinds, ranks disagreeing on shape or dtype, main replicas that
    overlap or leave a gap. Empty when valid."""
    kinds = {sh.kind for _, sh in shards}
    if len(kinds) > 1:
        return [f"{key!r} is used both as a ShardedTensor and a ShardedObject"]
    rank0, ref = shards[0]
    what = "ShardedObject " if ref.kind == "o" else ""
    for field in ("global_shape", "dtype"):  # an object's dtype is always ""
        for rank, sh in shards[1:]:
            if getattr(sh, field) != getattr(ref, field):
                return [
                    f"{what}{key!r}: {field} {getattr(sh, field)} on rank {rank} differs from "
                    f"{getattr(ref, field)} on rank {rank0}"
                ]
    if kinds == {"t"}:
        return _tensor_problems(key, shards)
    return _object_problems(key, shards)


def format_problems(problems: Sequence[str], count: Optional[int] = None) -> str:
    """The message of a `ShardingIntegrityError` for `problems` (`count`: how many there are
    in all, where only some are given)."""
    count = len(problems) if count is None else count
    shown = "\n  ".join(problems[:MAX_REPORTED])
    more = f"\n  ... and {count - MAX_REPORTED} more" if count > MAX_REPORTED else ""
    return f"Invalid sharding ({count} problem(s)):\n  {shown}{more}"


_LANE = (1 << 31) - 1
_COMMON_LANE = (1 << 20) - 1


@dataclass
class AgreementCache:
    """What one rank remembers of the last validation that passed (one per process for real
    jobs; one per simulated rank in `simulate`)."""

    local: Optional[bytes] = None  # this rank's records digest then
    world: int = 0


@dataclass(frozen=True)
class Agreement:
    """The outcome, the same on every rank."""

    digest: Tuple[int, ...]  # identifies every rank's shard records, by rank
    validated: bool  # the distributed check ran (False: skipped, nothing changed)
    common_differs: bool  # some rank's common state differs from another's
    shared: Tuple[int, ...] = ()  # the sum of every rank's `shared` lanes (one rank's value)


def _lanes(rank: int, records: bytes) -> Tuple[int, ...]:
    h = hashlib.blake2b(rank.to_bytes(8, "little") + records, digest_size=16).digest()
    return tuple(int.from_bytes(h[i : i + 4], "little") & _LANE for i in range(0, 16, 4))


def agreement_protocol(
    rank: int,
    world: int,
    records: Sequence[ShardRecord],
    cache: AgreementCache,
    *,
    error: Optional[BaseException] = None,
    common_digest: bytes = b"",
    validate: bool = True,
    what: str = "save",
    shared: Sequence[int] = (),
    flow: str = "",
) -> Protocol[Agreement]:
    """One rank's side of the agreement (a `coordination` protocol; see the module docstring).

    Args:
        records: this rank's shard records (`record_of`).
        cache: this rank's memory of the last validation that passed (updated here).
        error: this rank's failure while preparing, if any (raised on every rank).
        common_digest: a digest of this rank's common state (compared across ranks).
        validate: run the sharding check (False: only agree on failures and the digest).
        what: the step, for error messages.
        shared: small non-negative ints (< 2**31) summed over ranks: one rank's values, the
            others' zeros, reach every rank without a round trip of their own (the claim
            token of a save).
        flow: how this rank goes on (its strategies, sync or async), for messages: ranks
            going on differently would wait for each other in different collectives.

    Raises:
        CheckpointingException: on every rank, where any rank failed to prepare, or where
            ranks' `flow`s differ (naming each rank's).
        ShardingIntegrityError: on every rank, where the shards do not form valid tensors.
    """
    local = digest([tuple(r) for r in records])
    changed = int(validate and (cache.local != local or cache.world != world))
    c = int.from_bytes(hashlib.blake2b(common_digest, digest_size=4).digest(), "little")
    c &= _COMMON_LANE
    f = int.from_bytes(hashlib.blake2b(flow.encode(), digest_size=4).digest(), "little")
    f &= _COMMON_LANE
    head = (int(error is not None), *_lanes(rank, local), c, c * c, changed, f, f * f)
    sums = yield AllReduceSum((*head, *shared))
    if sums[0]:
        gathered = yield Gather(dumps(_dist.error_report(error)))
        reports = yield Broadcast(dumps([loads(g) for g in gathered] if gathered else []))
        _dist.raise_on_reported_errors(loads(reports), error, f"{what} (preparation)")
    if world * sums[9] != sums[8] ** 2:  # rare: who does what is gathered only then
        gathered = yield Gather(dumps(flow))
        flows = yield Broadcast(dumps([loads(g) for g in gathered] if gathered else []))
        raise CheckpointingException(
            _dist.flows_differ(
                what, loads(flows), "strategies, async_sharded_save and validate_access_integrity"
            )
        )
    agreement = Agreement(
        tuple(sums[1:5]), False, world * sums[6] != sums[5] ** 2, tuple(sums[len(head) :])
    )
    if not sums[7]:
        return agreement
    # Main replicas go to their key's owner. Of the other replicas only the shape and dtype
    # are checked: each kind of them goes to an aggregator of this rank's group of about
    # sqrt(world) ranks, which forwards each kind once, so that a key every rank holds (a
    # layer-stacked one) reaches its owner from ~2 sqrt(world) ranks, not from all of them.
    group, ranks = max(1, math.isqrt(world)), range(world)
    outgoing: Dict[int, List[Tuple[Any, ...]]] = defaultdict(list)
    kinds = set()
    for rec in records:
        if rec.replica_id == 0:
            outgoing[owner(rec.key, ranks)].append(("m", rank, *rec))
        elif (rec.kind, rec.key, rec.dtype, rec.global_shape) not in kinds:
            kinds.add((rec.kind, rec.key, rec.dtype, rec.global_shape))
            outgoing[owner(f"{rec.key}#{rank // group}", ranks)].append(("r", rank, *rec))
    received = yield AllToAll({dest: dumps(msgs) for dest, msgs in outgoing.items()})
    mine: List[Tuple[Any, ...]] = []
    forward: Dict[int, Dict[Tuple[Any, ...], Tuple[Any, ...]]] = defaultdict(dict)
    for src in sorted(received):
        for msg in loads(received[src]):
            if msg[0] == "m":
                mine.append(msg)
            else:  # as an aggregator: the first rank of each kind, per key owner
                forward[owner(msg[3], ranks)].setdefault((msg[3], msg[2], msg[4], msg[5]), msg)
    again = yield AllToAll({dest: dumps(list(kinds_.values())) for dest, kinds_ in forward.items()})
    for src in sorted(again):
        mine += loads(again[src])
    by_key: Dict[str, List[Tuple[int, ShardRecord]]] = defaultdict(list)
    for msg in sorted(mine, key=lambda m: m[1]):  # rank order: messages name the first rank
        rec = ShardRecord(*msg[2:])
        by_key[rec.key].append((msg[1], rec))
    problems = [p for key in sorted(by_key) for p in key_problems(key, by_key[key])]
    yield from fail_together(problems, format_problems, ShardingIntegrityError, sent=MAX_REPORTED)
    cache.local, cache.world = local, world
    return Agreement(agreement.digest, True, agreement.common_differs, agreement.shared)
