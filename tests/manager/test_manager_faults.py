"""CheckpointManager when a background (async) write fails on one rank, on 2 and 4 gloo
ranks: 'raise' raises on every rank at the next save / wait_until_finished / close,
'continue' logs and trains on; either way the failed checkpoint is never recorded as latest
nor loaded, its directory is removed, and the next due save runs normally."""

from __future__ import annotations

import pytest

from tests.manager import _manager_fault_fns

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    "world_size,on_error,where",
    [
        (2, "raise", "save"),
        (2, "raise", "finalize"),
        (2, "raise", "close"),
        (2, "continue", "save"),
        (2, "continue", "close"),
        (4, "raise", "save"),
        (4, "continue", "finalize"),
    ],
)
def test_failed_background_write_follows_the_policy_on_every_rank(
    world_factory, tmp_path, world_size, on_error, where
):
    results = world_factory(world_size).run_ok(
        _manager_fault_fns.failing_background_write, str(tmp_path), on_error, where, timeout=300
    )
    first = results[0]
    assert all(r == first for r in results), results  # every rank saw the same
    if on_error == "raise":
        assert first["raised_at"] == where and first["failed_saves"] == []
        assert f"rank {world_size - 1}" in first["error"] and "No space left" in first["error"]
    else:
        assert first["raised_at"] is None and first["failed_saves"] == [4]
    # the failed step 4 is never recorded, its directory is gone (a step-6 save scheduled
    # while 4 was in flight may have been committed right after, in the same call)
    assert first["latest_after_failure"] in (2, 6)
    assert 4 not in first["steps_after_failure"] and 2 in first["steps_after_failure"]
    if where == "close":  # nothing saved after it: a restart loads step 2
        assert first["steps_final"] == [2] and first["latest_final"] == 2
        assert first["loaded"] == 2
    else:  # the next due saves ran normally; retention keeps the 2 newest
        # (a `save` that raised saved nothing itself, so its step may be missing)
        last = first["last_step"] - first["last_step"] % 2
        final = first["steps_final"]
        assert len(final) == 2 and final[-1] == last and 4 not in final, final
        assert first["latest_final"] == last and first["loaded"] == last


@pytest.mark.parametrize("on_error", ["raise", "continue"])
def test_failed_local_background_write_follows_the_policy_on_every_rank(
    world_factory, tmp_path, on_error
):
    results = world_factory(2).run_ok(
        _manager_fault_fns.failing_local_background_write, str(tmp_path), on_error, timeout=300
    )
    for rank, seen in enumerate(results):
        if on_error == "raise":
            assert "rank 1" in seen["raised"] and seen["failed_saves"] == []
        else:
            assert seen["raised"] == "" and seen["failed_saves"] == [4]
        # the failed step's parts are gone; this rank's part of a complete step stays (2, or
        # 6 when its save, scheduled while 4 was in flight, already went through)
        parts = seen["parts_after_failure"]
        assert not any("iter_0000004" in name for name in parts), seen
        assert any(name.endswith(f"_{rank}_local.pt") for name in parts), seen
        assert seen["loaded"] == (8, "local")
