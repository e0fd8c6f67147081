"""Local checkpoints on gloo worlds of 2 and 4 ranks, each rank with its own "node" directory."""

from __future__ import annotations

import pickle
import time

import pytest

from tests.local import _local_fns as F

pytestmark = pytest.mark.timeout(240)


def _values(world, fn, *args, timeout=90):
    return world.run_ok(fn, *args, timeout=timeout)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("factor", [1, 2])
def test_round_trip_sync_and_async(world_factory, tmp_path, size, factor):
    world = world_factory(size)
    files = _values(world, F.save_iterations, str(tmp_path / "sync"), [1, 2], 1, factor, False)
    for rank, all_names in enumerate(files):
        # only the newest iteration is kept; with replication each rank also holds its peer's
        # part; the superseded parts are kept as spares for the next save to write over
        names = [n for n in all_names if not n.startswith("spare_")]
        assert f"iter_0000002_{rank}_local.pt" in names
        assert len(names) == factor and all(n.startswith("iter_0000002_") for n in names)
        assert len(all_names) - len(names) == factor
    for it, same, _ in _values(world, F.load_latest, str(tmp_path / "sync"), 1, factor):
        assert (it, same) == (2, True)
    files = _values(world, F.save_iterations, str(tmp_path / "async"), [4, 5, 6], 1, factor, True)
    files = [[x for x in n if not x.startswith("spare_")] for n in files]
    assert all(len(n) == factor and all(x.startswith("iter_0000006_") for x in n) for n in files)
    results = _values(world, F.load_latest, str(tmp_path / "async"), 1, factor)
    assert [r[:2] for r in results] == [(6, True)] * size
    assert [r[2] for r in results] == [(6, rank, "sess") for rank in range(size)]


@pytest.mark.parametrize("jump", [1, 2])
def test_lost_node_recovers_from_replica(world_factory, tmp_path, jump):
    world = world_factory(4)
    tmp = str(tmp_path)
    _values(world, F.save_iterations, tmp, [5], jump, 2, False)
    _values(world, F.remove_dirs, tmp, [1])
    assert _values(world, F.find_latest, tmp, jump, 2) == [5] * 4
    results = _values(world, F.load_latest, tmp, jump, 2)
    assert [r[:2] for r in results] == [(5, True)] * 4
    # cliques: jump 1 -> [0, 1], [2, 3]; jump 2 -> [0, 2], [1, 3]. Both copies of rank 1's part gone:
    _values(world, F.remove_dirs, tmp, [1, 0 if jump == 1 else 3])
    assert _values(world, F.find_latest, tmp, jump, 2) == [-1] * 4
    for name, message in world.run_ok(F.error_of, F.load_latest, tmp, jump, 2):
        assert name == "NoReplicasAvailableError"
        # both members of a clique lost their directories: both their parts are gone
        assert f"iteration 5's part of rank(s) {[0, 1] if jump == 1 else [1, 3]}" in message


def test_no_replica_error_names_iteration_and_rank(world_factory, tmp_path):
    """find_latest saw a copy, but it disappears before load: NoReplicasAvailableError everywhere."""
    world = world_factory(2)
    tmp = str(tmp_path)
    _values(world, F.save_iterations, tmp, [3], 1, 2, False)
    results = world.run_ok(F.error_of, F.load_after_losing_both_copies, tmp)
    for name, message in results:
        assert name == "NoReplicasAvailableError"
        assert "iteration 3, rank 1" in message


def test_corrupted_part_is_replaced_by_its_replica(world_factory, tmp_path):
    world = world_factory(2)
    tmp = str(tmp_path)
    _values(world, F.save_iterations, tmp, [4], 1, 2, False)
    _values(world, F.flip_byte, tmp, 0, 0, 100)  # rank 0's own copy of its part
    assert [r[:2] for r in _values(world, F.load_latest, tmp, 1, 2)] == [(4, True)] * 2


def test_find_latest_ignores_dirty_and_incomplete(world_factory, tmp_path):
    world = world_factory(2)
    tmp = str(tmp_path)
    _values(world, F.save_iterations, tmp, [2], 1, 1, False)
    # a newer iteration that only left dirty files, and one committed on rank 0 only
    _values(world, F.plant_files, tmp, "iter_0000009_0_local.dirty.pt", b"x")
    world.run_ok(F.plant_on_rank, tmp, 0, "iter_0000008_0_local.pt", b"x")
    assert _values(world, F.find_latest, tmp, 1, 1) == [2, 2]
    # without replication, another rank's part on disk does not count
    world.run_ok(F.plant_on_rank, tmp, 1, "iter_0000008_0_local.pt", b"x")
    world.run_ok(F.plant_on_rank, tmp, 0, "iter_0000008_1_local.pt", b"x")
    assert _values(world, F.find_latest, tmp, 1, 1) == [2, 2]


@pytest.mark.parametrize("is_async", [False, True])
def test_failed_save_keeps_previous_iteration(world_factory, tmp_path, is_async):
    world = world_factory(2)
    results = _values(world, F.failing_save, str(tmp_path), 1, is_async)
    for err, files, ok in results:
        assert err[0] in ("AsyncSaveError", "DistributedFailureError", "CheckpointingException")
        assert "rank 1" in err[1] and "No space left" in err[1]
        assert files == [f"iter_0000001_{files[0].split('_')[2]}_local.pt"]
        assert ok


def test_ranks_saving_sync_and_async_at_once_raise_at_once(world_factory, tmp_path):
    """Before, the async rank waited in its queue's collectives and the sync rank in the
    write's until the world was killed; now the save's first agreement compares them."""
    world = world_factory(2)
    start = time.monotonic()
    results = _values(world, F.half_async_save, str(tmp_path))
    assert time.monotonic() - start < 30
    for rank, (err, files, ok) in enumerate(results):
        assert err[0] == "CheckpointingException", err
        assert "rank 0: iteration=2, is_async=False" in err[1], err
        assert "rank 1: iteration=2, is_async=True" in err[1], err
        assert files == [f"iter_0000001_{rank}_local.pt"]  # nothing of 2 was written
        assert ok


def test_planted_pickle_is_refused(world_factory, tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    world = world_factory(2)
    payload = pickle.dumps(Evil())
    for name, _ in _values(world, F.planted_pickle_load, str(tmp_path), payload):
        # not a valid image: the file is refused, never unpickled
        assert name in ("NoReplicasAvailableError", "CheckpointCorruptedError")


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("is_async", [False, True])
def test_local_backend_round_trip(world_factory, tmp_path, factor, is_async):
    world = world_factory(2)
    tmp = str(tmp_path)
    files = _values(world, F.dc_save, tmp, 1, factor, is_async)
    # every rank's own directory holds its part, its own metadata.json and its claim
    assert files == [["0", "claim_0.json", "metadata.json"], ["1", "claim_1.json", "metadata.json"]]
    assert _values(world, F.is_checkpoint, tmp) == [True, True]
    assert _values(world, F.dc_load, tmp) == [True, True]


def test_local_backend_recovers_lost_node_and_refuses_other_layouts(world_factory, tmp_path):
    world = world_factory(4)
    tmp = str(tmp_path)
    _values(world, F.dc_save, tmp, 2, 2, False)
    _values(world, F.remove_dirs, tmp, [3])
    assert _values(world, F.dc_load, tmp) == [True] * 4
    for name, message in _values(world, F.dc_load_other_layout, tmp):
        assert name == "DistributedFailureError" or "torch_dist" in message
        assert "torch_dist" in message
    # the same checkpoint with a smaller world: a clear error pointing to torch_dist
    small = world_factory(2)
    for name, message in _values(small, F.dc_load_error, tmp):
        assert name == "IncompatibleCheckpointError" and "torch_dist" in message


def test_local_backend_refuses_a_larger_world(world_factory, tmp_path):
    tmp = str(tmp_path)
    _values(world_factory(2), F.dc_save, tmp, 1, 1, False)
    for name, message in _values(world_factory(4), F.dc_load_error, tmp):
        assert name == "IncompatibleCheckpointError" and "torch_dist" in message
