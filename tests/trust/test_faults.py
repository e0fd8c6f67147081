"""Faults on one rank: SIGKILL mid-save, a stuck rank, a full disk, a corrupted file.

Every surviving rank must raise (never hang) within a bounded time, naming the cause; a
half-written checkpoint is never taken for a complete one; the previous checkpoint still
loads bit-exactly; and a new save works.
"""

from __future__ import annotations

import pytest

from tests._world import get_world
from tests.trust import _trust_fns as F

pytestmark = pytest.mark.timeout(300)

# survivors learn of a dead peer from the broken connection, well before any timeout
_DEATH_BOUND_S = 30.0


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_sigkill_during_torch_dist_save(tmp_path, is_async):
    outcomes = get_world(2).run_tolerating_deaths(
        F.crash_during_save, str(tmp_path), 1, is_async, timeout=120
    )
    assert outcomes[1] is None, "the victim should have died"
    assert outcomes[0] is not None, "the survivor must not hang"
    name, message, seconds = outcomes[0].unwrap()
    assert name == "DistributedFailureError", message
    assert "rank 1's process is gone" in message
    assert seconds < _DEATH_BOUND_S
    for not_ckpt, a_ok, err, c_ok in get_world(2).run_ok(F.after_crash, str(tmp_path), timeout=120):
        assert not_ckpt and a_ok and c_ok
        assert err == "NotACheckpointError"


def test_sigkill_during_async_local_save(tmp_path):
    outcomes = get_world(2).run_tolerating_deaths(F.local_crash, str(tmp_path), 1, timeout=120)
    assert outcomes[1] is None and outcomes[0] is not None
    name, message, seconds = outcomes[0].unwrap()
    assert name == "DistributedFailureError" and seconds < _DEATH_BOUND_S, message
    assert "rank 1's process is gone" in message
    # iteration 2 never committed everywhere: 1 is the newest complete one, then 3 saves fine
    assert (
        get_world(2).run_ok(F.local_after_crash, str(tmp_path), timeout=120) == [(1, True, 3)] * 2
    )


def test_stuck_rank_fails_the_others_within_the_timeout(tmp_path):
    timeout_s = 4.0
    outcomes = get_world(2).run_tolerating_deaths(
        F.stuck_rank_save, str(tmp_path), 1, timeout_s, timeout=120
    )
    assert outcomes[0] is not None
    name, message, seconds = outcomes[0].unwrap()
    assert name == "DistributedFailureError" and "did not answer within 4 s" in message
    assert "process is gone" not in message  # stuck, not dead: never named as gone
    assert timeout_s * 0.8 <= seconds < timeout_s + 10
    assert outcomes[1] is None or outcomes[1].unwrap()[0] != ""  # the stuck rank fails too


def test_full_disk_on_one_rank_raises_on_every_rank(world_factory, tmp_path):
    world = world_factory(2)
    for name, message, seconds in world.run_ok(F.enospc_on_rank, str(tmp_path), 1):
        assert "failed on rank 1: OSError" in message and "No space left" in message, (
            name,
            message,
        )
        assert seconds < _DEATH_BOUND_S


def test_corrupted_data_file_raises_on_every_rank(world_factory, tmp_path):
    world = world_factory(2)
    for name, message, _ in world.run_ok(F.corrupt_and_load, str(tmp_path), 1):
        assert name == "CheckpointCorruptedError", message
        assert "rank 1" in message and "checksum mismatch" in message and "'w'" in message
