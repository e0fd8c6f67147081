"""The durability policy of local checkpoints, and what a crash leaves behind.

fsync=True (default without replication): parts are fsync'd before the rename and the
directory after it. fsync=False (default with replication): no fsync; a machine crash can
leave a committed part torn or missing, checksums detect it and the replica is used.
In both modes a `.dirty` part never counts, and a torn or missing committed part is either
replaced by its replica or reported on every rank, never loaded.
"""

from __future__ import annotations

import pytest

from . import _durability_fns as F

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("damage", ["torn", "missing"])
@pytest.mark.parametrize("fsync", [True, False])
def test_damaged_part_is_recovered_from_its_replica(world_factory, tmp_path, fsync, damage):
    world = world_factory(2)
    outcomes = world.run_ok(F.crash_after_commit, str(tmp_path), fsync, 2, damage, timeout=180)
    assert outcomes == [("", ""), ("", "")]


@pytest.mark.parametrize("damage", ["torn", "missing"])
@pytest.mark.parametrize("fsync", [True, False])
def test_damaged_part_without_replica_raises_on_every_rank(world_factory, tmp_path, fsync, damage):
    world = world_factory(2)
    outcomes = world.run_ok(F.crash_after_commit, str(tmp_path), fsync, 1, damage, timeout=180)
    for name, message in outcomes:
        assert name == "NoReplicasAvailableError", message
        assert "iteration 2" in message and "1" in message


@pytest.mark.parametrize(
    "fsync, factor, policy, synced",
    [
        (None, 1, True, True),  # default without replication: durable
        (None, 2, False, False),  # default with replication: the replica is the protection
        (True, 2, True, True),
        (False, 1, False, False),
    ],
)
def test_fsync_policy_defaults_and_overrides(
    world_factory, tmp_path, fsync, factor, policy, synced
):
    world = world_factory(2)
    for got_policy, calls in world.run_ok(F.fsync_calls, str(tmp_path), fsync, factor, timeout=180):
        assert got_policy is policy
        assert (calls > 0) is synced, calls
