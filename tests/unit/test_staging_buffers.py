"""Huge-page staging buffers for direct reads (`storage.buffers.staging`)."""

from __future__ import annotations

import os

import pytest

from dist_checkpointing.storage import buffers


@pytest.fixture
def thp_setting(tmp_path, monkeypatch):
    """Points the kernel's huge-page setting at a file the test writes."""
    path = tmp_path / "enabled"
    monkeypatch.setattr(buffers, "THP_ENABLED", str(path))
    buffers.huge_pages.cache_clear()
    yield path
    buffers.huge_pages.cache_clear()


@pytest.mark.parametrize(
    "setting, usable",
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        (None, False),  # no such file: not Linux, or no THP support
    ],
)
def test_huge_pages_follow_the_kernels_setting(thp_setting, setting, usable):
    if setting is not None:
        thp_setting.write_text(setting)
    assert buffers.huge_pages() is usable
    if not usable:
        assert buffers.staging(1 << 20) is None


def test_a_staging_buffer_is_huge_page_aligned_writable_and_of_the_size_asked():
    if not buffers.huge_pages():
        pytest.skip("this kernel gives no transparent huge pages")
    for nbytes in (4096, (2 << 20) + 4096, 17 << 20):
        buf = buffers.staging(nbytes)
        assert buf is not None and buf.size == nbytes
        assert buf.ctypes.data % buffers.HUGE == 0
        buf[:] = 7
        buf[-1] = 9
        assert int(buf[0]) == 7 and int(buf[-1]) == 9


@pytest.fixture
def empty_bounce_pool():
    """An empty pool before and after the test (buffers made under a fake setting are not
    kept for other tests)."""
    with buffers._lock:
        saved = list(buffers._free_bounce)
        buffers._free_bounce.clear()
    yield
    with buffers._lock:
        buffers._free_bounce[:] = saved


def test_bounce_buffers_are_staged_in_huge_pages_where_the_kernel_gives_them(empty_bounce_pool):
    if not buffers.huge_pages():
        pytest.skip("this kernel gives no transparent huge pages")
    buf = buffers.bounce()
    assert buf.size == buffers.BOUNCE
    assert buf.ctypes.data % buffers.HUGE == 0  # a staging buffer, not a 4 KiB-aligned mmap
    buffers.give_back(buf)
    assert buffers.bounce() is buf  # pooled


def test_bounce_buffers_without_huge_pages_are_page_aligned(thp_setting, empty_bounce_pool):
    thp_setting.write_text("always madvise [never]\n")
    buf = buffers.bounce()
    assert buf.size == buffers.BOUNCE and buf.ctypes.data % buffers.ALIGN == 0
    buf[:] = 3
    assert int(buf[-1]) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_pooled_bounce_buffer_is_private_to_the_process(empty_bounce_pool):
    # a forked child reusing its parent's pooled buffer must not write into the parent's
    buf = buffers.bounce()
    buf[:16] = 1
    buffers.give_back(buf)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        child = buffers.bounce()
        child[:16] = 2
        os._exit(0 if int(child[0]) == 2 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(buf[0]) == 1


@pytest.fixture
def empty_chunk_pool():
    """An empty pool of chunk-buffer pairs before and after the test."""
    with buffers.ChunkBuffers._lock:
        saved = list(buffers.ChunkBuffers._free)
        buffers.ChunkBuffers._free.clear()
    yield
    with buffers.ChunkBuffers._lock:
        buffers.ChunkBuffers._free[:] = saved


def test_chunk_buffers_are_staged_in_huge_pages_where_the_kernel_gives_them(empty_chunk_pool):
    if not buffers.huge_pages():
        pytest.skip("this kernel gives no transparent huge pages")
    pair = buffers.ChunkBuffers.acquire()
    assert [b.size for b in pair] == [buffers.CHUNK] * 2
    assert all(b.ctypes.data % buffers.HUGE == 0 for b in pair)
    buffers.ChunkBuffers.release(pair)
    assert buffers.ChunkBuffers.acquire() is pair  # pooled


def test_chunk_buffers_without_huge_pages_are_page_aligned(thp_setting, empty_chunk_pool):
    thp_setting.write_text("always madvise [never]\n")
    pair = buffers.ChunkBuffers.acquire()
    assert all(b.size == buffers.CHUNK and b.ctypes.data % buffers.ALIGN == 0 for b in pair)
    pair[1][:] = 5
    assert int(pair[1][-1]) == 5 and int(pair[0][-1]) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_pooled_chunk_buffer_is_private_to_the_process(empty_chunk_pool):
    # a forked writer reusing its parent's pooled pair must not write into the parent's
    pair = buffers.ChunkBuffers.acquire()
    pair[0][:16] = 1
    buffers.ChunkBuffers.release(pair)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        child = buffers.ChunkBuffers.acquire()
        child[0][:16] = 2
        os._exit(0 if int(child[0][0]) == 2 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(pair[0][0]) == 1
