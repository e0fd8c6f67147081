"""The streamed replication path: messages cut from an image's segments, and a replica file
written chunk by chunk as the chunks arrive (O_DIRECT or buffered), byte-exact."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.local.replication import _stream
from dist_checkpointing.storage import ALIGN, StreamedFile, direct, reset_direct_fallbacks


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)[:n]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5 * (1 << 20)), min_size=1, max_size=8),
    chunk=st.sampled_from([1 << 20, 3 << 20, 64 << 20]),
)
def test_messages_are_the_segments_bytes_in_order_and_large_pieces_are_not_copied(sizes, chunk):
    rng = np.random.default_rng(len(sizes))
    segments = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    messages = _stream.pack_messages(segments, chunk)
    joined = np.concatenate([*messages, np.empty(0, np.uint8)])
    assert joined.tobytes() == b"".join(s.tobytes() for s in segments)
    assert all(0 < m.size <= chunk for m in messages)
    # only pieces under SMALL (per chunk-sized cut of a segment) are copied into packs
    small = sum(
        min(chunk, n - lo) for n in sizes for lo in range(0, n, chunk) if n - lo < _stream.SMALL
    )
    copied = [m for m in messages if not any(np.shares_memory(m, s) for s in segments)]
    assert sum(m.size for m in copied) <= small


def _cuts(size: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    cuts = sorted({0, size, *rng.integers(0, size + 1, 12).tolist(), 4096, 4095, 8193})
    return [c for c in cuts if c <= size]


@pytest.mark.parametrize("use_direct", [True, False])
@pytest.mark.parametrize("placed", [True, False])
@pytest.mark.parametrize("fsync", [True, False])
@pytest.mark.parametrize("size", [0, 100, 4096, 3 * 4096 + 17, (1 << 20) + 4097])
def test_streamed_file_writes_the_chunks_bytes_exactly(tmp_path, use_direct, placed, fsync, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "part"
    out = StreamedFile(path, size, fsync=fsync, direct=use_direct)
    cuts = _cuts(size, size)
    for lo, hi in zip(cuts, cuts[1:]):
        buf = _aligned(hi - lo + 2 * ALIGN)
        start = lo % ALIGN if placed else lo % ALIGN + 1  # placed: zero-copy with O_DIRECT
        chunk = buf[start : start + hi - lo]
        chunk[:] = data[lo:hi]
        out.write(chunk, lo)
    out.close()
    assert path.read_bytes() == data.tobytes()


def test_streamed_file_refuses_a_chunk_out_of_order(tmp_path):
    out = StreamedFile(tmp_path / "p", 10, fsync=False)
    out.write(np.zeros(4, np.uint8), 0)
    with pytest.raises(ValueError, match="expected 4"):
        out.write(np.zeros(4, np.uint8), 6)
    out.abort()
    assert not (tmp_path / "p").exists()


def test_streamed_file_falls_back_to_buffered_writes_when_o_direct_is_refused(
    tmp_path, monkeypatch
):
    """The refusal comes part-way (after a partial page is held): every byte still lands."""
    size = 5 * 4096 + 123
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    real = direct.pwrite_all
    calls = {"n": 0}

    def refusing(fd, view, offset, path="", is_direct=False):
        if is_direct:
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(22, "Invalid argument (injected)")
        return real(fd, view, offset, path, is_direct)

    monkeypatch.setattr(direct, "pwrite_all", refusing)
    out = StreamedFile(tmp_path / "p", size, fsync=True, direct=True)
    try:
        for lo, hi in [(0, 100), (100, 4096 + 7), (4096 + 7, 3 * 4096 + 1), (3 * 4096 + 1, size)]:
            buf = _aligned(hi - lo + ALIGN)
            chunk = buf[lo % ALIGN : lo % ALIGN + hi - lo]
            chunk[:] = data[lo:hi]
            out.write(chunk, lo)
        out.close()
    finally:
        reset_direct_fallbacks()
    assert calls["n"] >= 2  # O_DIRECT was used, then refused
    assert (tmp_path / "p").read_bytes() == data.tobytes()
    assert os.path.getsize(tmp_path / "p") == size


@pytest.mark.timeout(240)
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("size,factor", [(2, 2), (3, 3)])
def test_replicated_save_streams_every_part_and_loads_bit_exactly(
    world_factory, tmp_path, size, factor, is_async
):
    from tests.local import _stream_fns as F

    results = world_factory(size).run_ok(F.round_trip, str(tmp_path), factor, is_async, timeout=150)
    for rank, (files, loaded, recovered) in enumerate(results):
        assert files == [f"iter_0000001_{owner}_local.pt" for owner in range(size)], files
        assert loaded and recovered, rank


@pytest.mark.timeout(240)
def test_failed_replica_write_fails_the_save_on_every_rank_without_a_hang(world_factory, tmp_path):
    from tests.local import _stream_fns as F

    results = world_factory(2).run_ok(F.failing_receiver, str(tmp_path), timeout=150)
    for (name, message), files, ok in results:
        assert name and "rank 0" in message and "No space left" in message, (name, message)
        assert files == ["iter_0000001_0_local.pt", "iter_0000001_1_local.pt"], files
        assert ok
