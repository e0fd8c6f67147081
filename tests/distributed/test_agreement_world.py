"""The coordination protocols on a real 8-rank gloo world give what their simulation gives."""

from __future__ import annotations

import pytest

from dist_checkpointing._sharding_agreement import AgreementCache, agreement_protocol
from dist_checkpointing.exchange_utils import distribution_protocol
from tests._simulate import simulate
from tests.distributed._rank_fns import (
    agreement_on_this_rank,
    fully_parallel_grid_save,
    saves_with_one_rank_changed,
)
from tests.unit.test_sharding_agreement import grid_records


def _simulated(records, repeat):
    world = len(records)
    caches = [AgreementCache() for _ in range(world)]
    out = []
    for _ in range(repeat):
        got, _ = simulate(
            [agreement_protocol(r, world, records[r], caches[r]) for r in range(world)],
            return_exceptions=True,
        )
        out.append(got)
    return out


@pytest.mark.timeout(180)
def test_a_real_world_and_the_simulation_agree(world_factory):
    records = grid_records(8, tp=4, keys=12)
    real = world_factory(8).run_ok(agreement_on_this_rank, records, 2, timeout=120)
    sim = _simulated(records, 2)
    for rank in range(8):
        assert real[rank] == [sim[0][rank], sim[1][rank]]
    assert real[0][0].validated and not real[0][1].validated


@pytest.mark.timeout(180)
def test_a_layout_that_differs_on_one_rank_fails_every_real_rank_as_simulated(world_factory):
    records = grid_records(8, tp=4, keys=12)
    records[5][3] = records[5][3]._replace(global_shape=(16, 7))
    real = world_factory(8).run_ok(agreement_on_this_rank, records, 1, timeout=120)
    (sim,) = _simulated(records, 1)
    assert len(set(real)) == 1
    assert real[0] == f"ShardingIntegrityError: {sim[0]}"
    assert "global_shape (16, 7) on rank 5" in real[0]


@pytest.mark.timeout(180)
def test_a_shard_changed_on_one_rank_between_cached_saves_drops_and_misplaces_nothing(
    world_factory, tmp_path
):
    problems = world_factory(4).run_ok(saves_with_one_rank_changed, str(tmp_path), timeout=150)
    assert problems == [[]] * 4


@pytest.mark.timeout(180)
def test_a_real_fully_parallel_save_writes_the_plan_the_simulation_makes(world_factory, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    world, tp, keys = 8, 4, 6
    real = world_factory(world).run_ok(
        fully_parallel_grid_save, str(tmp_path), tp, keys, timeout=120
    )
    shards = [
        {
            (f"layer{k}.weight", (4 * (r % tp), 0)): (4 * 4 * 8 * (k + 1), r < tp)
            for k in range(keys)
        }
        for r in range(world)
    ]
    sim, _ = simulate(
        [distribution_protocol(r, range(world), shards[r], True) for r in range(world)]
    )
    assert real == sim
    written = {
        (index.fqn, tuple(index.offset)): int(info.relative_path.split("_")[-2])
        for index, info in FileSystemReader(str(tmp_path)).read_metadata().storage_data.items()
    }
    # every shard once, in the file of the rank the simulation chose; the writing spread out
    assert written == {sid: saver for per_rank in sim for sid, saver in per_rank.items()}
    assert len(set(written.values())) == world
