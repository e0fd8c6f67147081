"""The agreement that starts every save (and a validated load), as one `coordination` protocol.

1. One sum carries each rank's failure flag, four lanes of a digest of `(rank, its shard
   records)` (the sums identify the job's sharding), two lanes comparing the common state,
   and whether the rank's records changed since the last check that passed.
2. Any failure: the reports are gathered at rank 0 and broadcast; every rank raises.
3. Nothing changed anywhere: done. Otherwise main-replica records go to their key's owner
   (a hash of the key) and, of other replicas, one record per key, dtype and shape goes
   through an aggregator for a group of about sqrt(world) ranks; owners check their keys
   (`_sharding_records.key_problems`), the problem count is summed, and any problems are
   gathered at rank 0, whose message every rank raises as `ShardingIntegrityError`.

No rank receives data proportional to world x tensors.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _dist
from ._sharding_records import ShardRecord, key_problems
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
from .errors import ShardingIntegrityError
from .validation import format_problems

__all__ = ["Agreement", "AgreementCache", "agreement_protocol"]

#: problems each owner sends rank 0 at most (the message shows `validation._MAX_REPORTED`)
_SENT_PROBLEMS = 20
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


def records_digest(records: Sequence[ShardRecord]) -> bytes:
    """A digest of one rank's records (in order)."""
    return digest([tuple(r) for r in records])


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
) -> Protocol[Agreement]:
    """One rank's side of the agreement (a `coordination` protocol; see the module docstring).

    Args:
        rank, world: this rank and the number of ranks.
        records: this rank's shard records (`_sharding_records.record_of`).
        cache: this rank's memory of the last validation that passed (updated here).
        error: this rank's failure while preparing, if any (raised on every rank).
        common_digest: a digest of this rank's common state (compared across ranks).
        validate: run the sharding check (False: only agree on failures and the digest).
        what: the step, for error messages.

    Raises:
        CheckpointingException: on every rank, where any rank failed to prepare.
        ShardingIntegrityError: on every rank, where the shards do not form valid tensors.
    """
    local = records_digest(records)
    changed = int(validate and (cache.local != local or cache.world != world))
    c = int.from_bytes(hashlib.blake2b(common_digest, digest_size=4).digest(), "little")
    c &= _COMMON_LANE
    sums = yield AllReduceSum((int(error is not None), *_lanes(rank, local), c, c * c, changed))
    if sums[0]:
        gathered = yield Gather(dumps(_dist.error_report(error)))
        reports = yield Broadcast(dumps([loads(g) for g in gathered] if gathered else []))
        _dist.raise_on_reported_errors(loads(reports), error, f"{what} (preparation)")
    agreement = Agreement(tuple(sums[1:5]), False, world * sums[6] != sums[5] ** 2)
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
    yield from fail_together(problems, format_problems, ShardingIntegrityError, sent=_SENT_PROBLEMS)
    cache.local, cache.world = local, world
    return Agreement(agreement.digest, True, agreement.common_differs)
