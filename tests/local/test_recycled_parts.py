"""Superseded local parts are recycled: renamed to spares, then written over in place by
the next save (no block allocation, no freeing of the old blocks). A spare is never taken
for a part, and a crash during or after an overwrite never loads an older part's bytes."""

from __future__ import annotations

import pytest

from . import _recycle_fns as F

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("factor", [1, 2])
def test_next_save_writes_over_the_superseded_parts(world_factory, tmp_path, factor):
    world = world_factory(2)
    for recycled, exact, spares, sizes_ok in world.run_ok(
        F.saves_write_over_spares, str(tmp_path), factor, timeout=180
    ):
        assert recycled and exact and sizes_ok
        assert spares == [0, factor, factor, factor]


@pytest.mark.parametrize("how", ["old", "mixed"])
@pytest.mark.parametrize("fsync", [True, False])
def test_committed_part_with_older_bytes_is_recovered_from_its_replica(
    world_factory, tmp_path, fsync, how
):
    world = world_factory(2)
    outcomes = world.run_ok(
        F.committed_part_holds_older_bytes, str(tmp_path), 2, fsync, how, timeout=180
    )
    assert outcomes == [("", ""), ("", "")]


@pytest.mark.parametrize("how", ["old", "mixed"])
def test_committed_part_with_older_bytes_without_replica_raises_on_every_rank(
    world_factory, tmp_path, how
):
    world = world_factory(2)
    for name, message in world.run_ok(
        F.committed_part_holds_older_bytes, str(tmp_path), 1, False, how, timeout=180
    ):
        assert name == "NoReplicasAvailableError", message
        assert "iteration 3" in message


def test_crash_while_writing_over_a_spare_leaves_the_previous_checkpoint(world_factory, tmp_path):
    world = world_factory(2)
    for latest, first, again, exact, left in world.run_ok(
        F.crash_while_writing_over_a_spare, str(tmp_path), timeout=180
    ):
        assert latest == 2 and first and exact
        assert again == "SameMachineReplicationException"
        assert left == []


@pytest.mark.parametrize("factor", [1, 2])
def test_loaded_tensors_keep_their_values_while_later_saves_recycle_parts(
    world_factory, tmp_path, factor
):
    """A load maps its part file; the tensors a user keeps from it are neither changed by the
    saves after it (which write over superseded parts) nor write back into the file."""
    world = world_factory(2)
    outcomes = world.run_ok(
        F.loaded_tensors_outlive_later_saves, str(tmp_path), factor, timeout=180
    )
    assert outcomes == [(True, True, True, True)] * 2
