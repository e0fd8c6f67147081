"""The rule choosing files (writer threads) per rank for a torch_dist sync save."""

from __future__ import annotations

import pytest

from dist_checkpointing.storage import threads
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy


@pytest.mark.parametrize(
    "cores, cuda, files",
    [
        (0.5, False, 1),  # this CI machine: 2 cores, 4 ranks
        (1, True, 1),
        (2, False, 1),
        (3.9, True, 1),
        (4, False, 1),
        (4, True, 2),
        (8, False, 2),
        (8, True, 4),
        (16, True, 4),  # one rank on a 16-core GPU node (4 files measured 1.7x faster than 1)
        (16, False, 4),
        (200, True, 4),
    ],
)
def test_file_count_follows_cores_per_local_rank_and_sources(cores, cuda, files):
    assert threads.default_file_count(cuda, cores) == files


def test_cores_are_shared_by_the_ranks_of_the_node(monkeypatch):
    monkeypatch.setattr(threads, "_cpu_quota", lambda: None)  # whatever this machine has
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert threads.cores_per_local_rank(False, cpu_count=64) == 8
    # a launcher that bound the rank to its own cores: those are its cores
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert threads.cores_per_local_rank(False, cpu_count=64) == 3


def test_explicit_thread_count_wins_and_default_is_chosen_per_save():
    assert TorchDistSaveShardedStrategy(thread_count=3)._file_count([]) == 3
    assert TorchDistSaveShardedStrategy()._file_count([]) == threads.default_file_count(False)


def test_a_container_cpu_quota_caps_the_cores(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(threads._dist, "get_world_size", lambda: 1)
    # 64 visible cores, 2 of them allowed: the 2-core rule (one file), not 64 cores' (4)
    assert threads.cores_per_local_rank(False, cpu_count=64, quota=2.0) == 2
    assert threads.default_file_count(False, threads.cores_per_local_rank(False, 64, 2.0)) == 1
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("200000 100000\n")
    assert threads._cpu_quota(str(cpu_max)) == 2.0
    cpu_max.write_text("max 100000\n")
    assert threads._cpu_quota(str(cpu_max)) is None
    assert threads._cpu_quota(str(tmp_path / "missing")) is None
