"""The reference's overwrite rules for local checkpoints (nvidia-resiliency-ext's
`LocalCheckpointManager`), on 2 ranks with and without replication.

- A dirty file of the iteration being saved (another writer on the machine, or an
  interrupted save) raises `SameMachineReplicationException` on every rank, and is left
  alone.
- A fresh save of an iteration that is already committed (a job restarted from an older
  checkpoint reaches it again) replaces it; every part of the result is new, and a failed
  overwrite leaves no mix of old and new parts.
"""

from __future__ import annotations

import pytest

from tests.local import _overwrite_fns as F

pytestmark = pytest.mark.timeout(240)
WORLD = 2


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("factor", [1, 2])
def test_restarted_job_overwrites_a_committed_iteration(world_factory, tmp_path, factor, is_async):
    results = world_factory(WORLD).run_ok(
        F.restart_and_overwrite, str(tmp_path), factor, is_async, timeout=120
    )
    for rank, (latest, loaded_run, parts) in enumerate(results):
        assert latest == 3 and loaded_run == 2
        assert len(parts) == factor and (rank, 2) in parts
        assert all(run == 2 for _, run in parts), parts  # every part held here is new


@pytest.mark.parametrize("phase", ["write", "commit"])
@pytest.mark.parametrize("factor", [1, 2])
def test_failed_overwrite_leaves_no_mix_of_old_and_new_parts(
    world_factory, tmp_path, factor, phase
):
    results = world_factory(WORLD).run_ok(
        F.restart_and_fail, str(tmp_path), factor, phase, 1, timeout=120
    )
    for (name, message), latest, parts in results:
        assert name and "rank 1" in message, (name, message)
        assert latest == -1  # iteration 3 is gone entirely: neither old nor half new
        assert all(run == 2 for _, run in parts), parts  # nothing of the old run is left


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("factor", [1, 2])
def test_dirty_file_of_the_same_iteration_raises_same_machine_replication(
    world_factory, tmp_path, factor, when
):
    # with replication, the dirty file is rank 0's replica of rank 1's part
    owner = 1 if factor == 2 else 0
    results = world_factory(WORLD).run_ok(
        F.save_with_dirty_file, str(tmp_path), factor, 0, owner, when, timeout=120
    )
    for (name, message), intact, latest in results:
        assert name == "SameMachineReplicationException", (name, message)
        assert "rank 0" in message and "iteration 3" in message
        assert intact and latest == 2  # the previous iteration stays the newest complete one
