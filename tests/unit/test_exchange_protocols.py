"""Who writes (or reads) each replicated shard, and the exchange plan, simulated for many ranks:
the protocols the fully parallel wrappers run (tests/distributed/test_fully_parallel.py runs
them on gloo)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest

from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.exchange_utils import distribution_protocol, exchange_plan_protocol
from tests._simulate import simulate


def tp_dp_shards(world: int, tp: int, keys: int) -> List[Dict[Tuple, Tuple[int, bool]]]:
    """Per rank: `keys` row blocks over `tp` ranks, replicated over world // tp (main: DP 0),
    of growing sizes; plus a norm replicated over every rank (main on rank 0)."""
    out = []
    for rank in range(world):
        t, d = rank % tp, rank // tp
        shards = {(f"w{k}", (4 * t, 0)): (100 * (k + 1), d == 0) for k in range(keys)}
        shards[("norm", (0,))] = (8, rank == 0)
        out.append(shards)
    return out


def dp_groups(world: int, tp: int) -> List[Sequence[int]]:
    return [tuple(range(rank % tp, world, tp)) for rank in range(world)]


def run(shards, groups, only_main=False):
    protos = [distribution_protocol(r, groups[r], shards[r], only_main) for r in range(len(shards))]
    return simulate(protos, return_exceptions=True)


def check_consistent(shards, savers, groups, only_main=False):
    """Every shard held in a group has one saver, a holder, on whom all holders agree; the
    bytes of the shards with the same holders are balanced over them within one shard."""
    per_group: Dict[Tuple, Dict[Tuple, int]] = {}
    for rank, saver in enumerate(savers):
        group = tuple(sorted(groups[rank]))
        agreed = per_group.setdefault(group, {})
        for sid, who in saver.items():
            assert sid in shards[rank] and who in group and sid in shards[who]
            assert agreed.setdefault(sid, who) == who
        kept = {s for s, (_, m) in shards[rank].items() if not only_main or m}
        if not only_main:
            assert set(saver) == set(shards[rank])
        else:
            assert kept <= set(saver)
    for group, agreed in per_group.items():
        by_holders: Dict[Tuple, List[Tuple]] = {}
        for sid in agreed:
            holders = tuple(r for r in group if sid in shards[r])
            by_holders.setdefault(holders, []).append(sid)
        for holders, sids in by_holders.items():
            load = {r: 0 for r in holders}
            for sid in sids:
                load[agreed[sid]] += shards[agreed[sid]][sid][0]
            biggest = max(shards[agreed[s]][s][0] for s in sids)
            assert max(load.values()) - min(load.values()) <= biggest


@pytest.mark.parametrize("only_main", [False, True])
def test_replicas_are_shared_out_once_per_group_with_balanced_bytes(only_main):
    world, tp = 64, 4
    shards = tp_dp_shards(world, tp, keys=12)
    groups = dp_groups(world, tp)
    savers, stats = run(shards, groups, only_main)
    check_consistent(shards, savers, groups, only_main)
    if only_main:  # the norm's main replica is on rank 0: only rank 0's group writes it
        assert all((("norm", (0,)) in s) == (r % tp == 0) for r, s in enumerate(savers))
    # members hold the same shards: one digest each to the leader, a short reply, no records
    assert len(stats.exchanges) == 3


def test_groups_whose_members_hold_different_shards_still_agree():
    world, tp = 32, 4
    shards = tp_dp_shards(world, tp, keys=6)
    for rank in (4, 9, 30):  # some replicas lack a shard, one holds an extra
        del shards[rank][("w2", (4 * (rank % tp), 0))]
    shards[13][("extra", (0,))] = (500, True)
    groups = [tuple(range(world))] * world  # one group: the whole world
    savers, stats = run(shards, groups)
    check_consistent(shards, savers, groups)
    assert savers[13][("extra", (0,))] == 13


def test_ranks_that_disagree_on_their_group_fail_on_every_rank():
    world = 8
    shards = tp_dp_shards(world, 2, keys=2)
    groups = dp_groups(world, 2)
    groups[3] = (1, 3, 5)  # rank 3 leaves out rank 7
    results, _ = run(shards, groups)
    assert all(isinstance(r, CheckpointingException) for r in results)
    assert all("disagree" in str(r) and "parallelization group" in str(r) for r in results)


def test_the_bytes_a_rank_receives_do_not_grow_with_the_world():
    received = []
    for world in (64, 1024):
        shards = tp_dp_shards(world, 8, keys=40)
        _, stats = run(shards, dp_groups(world, 8), only_main=True)
        received.append(stats.max_recv_bytes)
        # and when the groups are uneven, the per-shard records go to owners
        for rank in range(0, world, 7):
            shards[rank].pop(("w0", (4 * (rank % 8), 0)))
        _, stats = run(shards, dp_groups(world, 8), only_main=True)
        received.append(stats.max_recv_bytes)
    small_even, small_uneven, big_even, big_uneven = received
    # 16x the ranks: a leader gets one digest per member, so 16x (a DP group grew 16x), but
    # nothing close to the 16x40x more records a world-wide gather would deliver
    assert big_even < 20 * small_even and big_uneven < 20 * small_uneven


def plan(have: List[Dict[Tuple, Tuple]], need: List[List[Tuple]]):
    world = len(have)
    protos = [exchange_plan_protocol(r, world, have[r], need[r]) for r in range(world)]
    return simulate(protos, return_exceptions=True)


def test_each_needed_shard_comes_from_its_lowest_holder_in_one_order_on_both_ends():
    world = 16
    meta = ((2, 3), "float32")
    have = [
        {(f"k{k}", (0,)): meta for k in range(8) if k % world in (r, r - 3)} for r in range(world)
    ]
    need = [
        [(f"k{k}", (0,)) for k in range(8) if (f"k{k}", (0,)) not in have[r]] for r in range(world)
    ]
    plans, _ = plan(have, need)
    for rank, transfers in enumerate(plans):
        assert transfers == sorted(transfers, key=lambda t: (t[0], t[2]))
        for sid, src, dst, got_meta in transfers:
            assert rank in (src, dst) and got_meta == meta
            assert src == min(r for r in range(world) if sid in have[r])
            assert sid in need[dst]
            # the other end lists the same transfer
            assert (sid, src, dst, got_meta) in plans[dst if rank == src else src]
        wanted_here = {t[0] for t in transfers if t[2] == rank}
        assert wanted_here == set(need[rank])


def test_a_shard_nobody_holds_fails_on_every_rank_naming_it():
    have = [{("a", (0,)): ((1,), "int64")}, {}, {}]
    need = [[], [("a", (0,)), ("b", (4,))], []]
    results, _ = plan(have, need)
    assert all(isinstance(r, CheckpointingException) for r in results)
    assert all("'b', (4,)" in str(r) and "[1]" in str(r) for r in results)
