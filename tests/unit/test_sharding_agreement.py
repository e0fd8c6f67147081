"""The save's agreement protocol, simulated for many ranks in one process: the same code a real
job runs (tests/distributed/test_agreement_world.py runs it on gloo and compares)."""

from __future__ import annotations

from typing import List

import pytest

from dist_checkpointing._sharding_agreement import AgreementCache, ShardRecord, agreement_protocol
from dist_checkpointing.coordination import dumps
from dist_checkpointing.errors import CheckpointingException, ShardingIntegrityError
from tests._simulate import simulate


def grid_records(world: int, tp: int = 4, keys: int = 6) -> List[List[ShardRecord]]:
    """Per rank: keys split in row blocks over `tp` ranks, replicated over world // tp."""
    out = []
    for rank in range(world):
        t, dp = rank % tp, rank // tp
        recs = [
            ShardRecord(
                "t", f"layer{k}.weight", "torch.float32", (tp * 4, 8), (4 * t, 0), (4, 8), dp
            )
            for k in range(keys)
        ]
        recs.append(ShardRecord("o", "rng", "", (world,), (rank,), (), 0))
        out.append(recs)
    return out


def run_all(records, caches, **kwargs):
    world = len(records)
    protos = [agreement_protocol(r, world, records[r], caches[r], **kwargs) for r in range(world)]
    return simulate(protos, return_exceptions=True)


def test_a_valid_sharding_is_checked_once_then_skipped_while_nothing_changes():
    world = 64
    records = grid_records(world, keys=40)
    caches = [AgreementCache() for _ in range(world)]
    first, stats = run_all(records, caches)
    assert all(a.validated for a in first) and len({a.digest for a in first}) == 1
    again, warm = run_all(records, caches)
    assert not any(a.validated for a in again)
    assert {a.digest for a in again} == {first[0].digest}
    assert len(warm.exchanges) == 1  # one sum, nothing else
    # each owner receives only its keys' records, far from what an all-gather gives everyone
    everyone = sum(len(dumps([tuple(x) for x in r])) for r in records)
    assert stats.max_recv_bytes < everyone / 5


def test_a_shard_changed_on_one_rank_is_checked_again_and_caught_on_every_rank():
    world = 32
    records = grid_records(world)
    caches = [AgreementCache() for _ in range(world)]
    run_all(records, caches)
    moved = records[5][2]._replace(global_offset=(moved_row := 0, 0))  # overlaps rank 4's rows
    assert moved_row == 0
    records[5][2] = moved._replace(replica_id=0)
    records[1][2] = records[1][2]._replace(replica_id=1)  # rank 1 gives up its main copy
    got, _ = run_all(records, caches)
    assert all(isinstance(e, ShardingIntegrityError) for e in got), got
    assert len({str(e) for e in got}) == 1
    assert "'layer2.weight'" in str(got[0])


def test_a_global_shape_that_differs_on_one_rank_is_named_on_every_rank():
    world = 16
    records = grid_records(world)
    records[9][0] = records[9][0]._replace(global_shape=(16, 9))
    got, _ = run_all(records, [AgreementCache() for _ in range(world)])
    assert all(isinstance(e, ShardingIntegrityError) for e in got)
    msg = str(got[3])
    assert "'layer0.weight': global_shape (16, 9) on rank 9 differs from (16, 8)" in msg


def test_a_gap_and_a_duplicate_object_are_reported():
    world = 8
    records = grid_records(world)
    records[0] = [
        r for r in records[0] if r.key != "layer1.weight"
    ]  # rows 0-4 of layer1: 32 of 128 elements
    records[3][-1] = records[3][-1]._replace(global_offset=(2,))  # rank 3 claims rank 2's rng
    got, _ = run_all(records, [AgreementCache() for _ in range(world)])
    msg = str(got[0])
    assert "2 problem(s)" in msg
    assert "'layer1.weight': main replicas cover 96 of 128 elements" in msg
    assert "Duplicate ShardedObject keys" in msg and "rng/shard_2_8" in msg


def test_a_duplicate_object_on_a_2d_grid_is_named_as_its_unique_key():
    from dist_checkpointing import ShardedObject

    world = 4
    records = [[ShardRecord("o", "rng", "", (2, 2), (r // 2, r % 2), (), 0)] for r in range(world)]
    records[3] = [records[3][0]._replace(global_offset=(1, 0))]  # rank 3 claims rank 2's place
    got, _ = run_all(records, [AgreementCache() for _ in range(world)])
    name = ShardedObject("rng", None, (2, 2), (1, 0)).unique_key
    assert all(name in str(e) for e in got), (name, str(got[0]))


def test_a_preparation_failure_on_one_rank_raises_on_every_rank():
    world = 8
    records = grid_records(world)
    protos = [
        agreement_protocol(
            r,
            world,
            records[r],
            AgreementCache(),
            error=ValueError("disk on fire") if r == 6 else None,
        )
        for r in range(world)
    ]
    got, _ = simulate(protos, return_exceptions=True)
    assert all(isinstance(e, CheckpointingException) for e in got)
    assert all("rank 6" in str(e) and "disk on fire" in str(e) for e in got)


@pytest.mark.parametrize("world", [16, 256])
def test_common_state_differences_are_agreed_on(world):
    records = grid_records(world)
    protos = [
        agreement_protocol(
            r, world, records[r], AgreementCache(), common_digest=b"x" if r != 3 else b"y"
        )
        for r in range(world)
    ]
    got, _ = simulate(protos)
    assert all(a.common_differs for a in got)
    same, _ = simulate(
        [agreement_protocol(r, world, records[r], AgreementCache()) for r in range(world)]
    )
    assert not any(a.common_differs for a in same)


@pytest.mark.parametrize("world", [4, 256])
def test_ranks_called_with_different_strategies_raise_on_every_rank_naming_each(world):
    """A rank saving another way than the others (another strategy, async where they are
    not) would wait in other collectives until the timeout: every rank raises at once."""
    records = grid_records(world)
    flows = ["torch_dist 1, async" if r == 2 else "torch_dist 1, sync" for r in range(world)]
    protos = [
        agreement_protocol(r, world, records[r], AgreementCache(), flow=flows[r], what="save to X")
        for r in range(world)
    ]
    got, _ = simulate(protos, return_exceptions=True)
    assert all(isinstance(e, CheckpointingException) for e in got), got[:3]
    for e in got:
        assert "save to X" in str(e) and "rank 2: torch_dist 1, async" in str(e), str(e)
        assert "torch_dist 1, sync" in str(e)
    alike = [
        agreement_protocol(r, world, records[r], AgreementCache(), flow="a") for r in range(world)
    ]
    same, _ = simulate(alike)
    assert all(a.validated for a in same)
