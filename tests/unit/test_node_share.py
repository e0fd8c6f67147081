"""Shared-memory segments and their semaphores (`storage.node_share`), in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from dist_checkpointing.storage import node_share

pytestmark = pytest.mark.skipif(
    not node_share.available(), reason="needs /dev/shm and POSIX semaphores"
)


@pytest.fixture
def segment():
    seg = node_share.Segment.create(world=4, slots=2, slot_bytes=8192)
    yield seg
    seg.close()
    seg.unlink()


def never() -> None:
    pass


def test_a_peer_sees_the_owners_windows_and_semaphores(segment):
    peer = node_share.Segment.attach(segment.path, 4, 2, 8192)
    try:
        segment.window(1)[:5] = list(b"hello")
        got = []

        def consume() -> None:
            node_share.wait(peer.ready_sem(2), never, 5, "the owner")
            got.append(bytes(peer.window(1)[:5]))
            node_share.post(peer.free_sem(3))

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.3)  # the consumer waits: nothing posted yet
        assert got == []
        node_share.post(segment.ready_sem(2))
        node_share.wait(segment.free_sem(3), never, 5, "the consumer")
        t.join()
        assert got == [b"hello"]
    finally:
        peer.close()


def test_a_wait_stops_when_a_peer_failed_died_or_stalled(segment, monkeypatch):
    monkeypatch.setattr(node_share, "POLL_S", 0.05)
    other = node_share.Segment.create(world=4, slots=2, slot_bytes=8192)  # rank 1's
    peer = node_share.Segment.attach(other.path, 4, 2, 8192)
    try:
        check = node_share.peers_check([segment, peer], [os.getpid(), os.getpid()], [0, 1])
        other.mark_failed()
        start = time.monotonic()
        with pytest.raises(node_share.SharedReadAborted, match="rank 1 of this node failed"):
            node_share.wait(segment.ready_sem(1), check, 60, "rank 1")
        assert time.monotonic() - start < 5
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        dead = node_share.peers_check([segment, None], [os.getpid(), int(gone.stdout)], [0, 1])
        with pytest.raises(node_share.SharedReadAborted, match="died"):
            node_share.wait(segment.ready_sem(1), dead, 60, "rank 1")
        with pytest.raises(node_share.SharedReadAborted, match="no progress in 0 s"):
            node_share.wait(segment.ready_sem(1), never, 0.1, "rank 1")
    finally:
        peer.close()
        other.close()
        other.unlink()


def test_segments_of_dead_processes_are_removed_and_live_ones_kept(segment):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = os.path.join(node_share.SHM_DIR, f"{node_share.PREFIX}-{int(gone.stdout)}-x")
    open(stale, "wb").close()
    other = node_share.Segment.create(world=1, slots=1, slot_bytes=4096)
    try:
        assert not os.path.exists(stale)
        assert os.path.exists(segment.path)  # this process's, alive
    finally:
        other.close()
        other.unlink()


def test_a_segment_larger_than_shared_memory_is_an_error_not_a_crash(monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir(node_share.SHM_DIR))
    with pytest.raises(OSError, match="No space"):
        node_share.Segment.create(world=2, slots=1, slot_bytes=4096)
    assert set(os.listdir(node_share.SHM_DIR)) <= before  # nothing left behind
