"""A shared reader's reads ahead (`shared_read._ReadAhead`), on real files in one process:
every window's bytes, reads that cross from one chunk's file into the next, buffered files
read straight into the window, and nothing left in flight after `close`."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

from dist_checkpointing.storage import direct, faults
from dist_checkpointing.strategies.torch_dist import shared_read as sr

WINDOW = 64 << 10


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(sr, "WINDOW", WINDOW)
    monkeypatch.setattr(sr, "SLACK", 0)
    monkeypatch.setattr(sr, "PRE", 4096)
    monkeypatch.setattr(sr, "AHEAD", 3)
    yield
    direct.reset_direct_fallbacks()


def files(tmp_path, sizes):
    rng = np.random.default_rng(7)
    out = []
    for i, n in enumerate(sizes):
        d = tmp_path / f"d{i}"
        d.mkdir()
        p = d / "data.distcp"
        data = rng.integers(0, 256, n, dtype=np.uint8)
        p.write_bytes(data.tobytes())
        out.append((str(p), data))
    return out


def windows(made):
    return [
        (path, lo, min(WINDOW, len(data) - lo))
        for path, data in made
        for lo in range(0, len(data), WINDOW)
    ]


def test_every_window_holds_its_bytes_while_the_next_ones_are_read_into_other_buffers(
    small, tmp_path
):
    made = files(tmp_path, [8 * WINDOW, 5 * WINDOW])
    plan = windows(made)
    data = {path: d for path, d in made}
    ahead = sr._ReadAhead(plan)
    try:
        if not ahead.direct(0):
            pytest.skip("O_DIRECT refused here: nothing is read ahead")
        seen = set()
        for j, (path, lo, n) in enumerate(plan):
            got, stage = ahead.take(j)
            assert got == n
            seen.add(stage.ctypes.data)
            time.sleep(0.005)  # the reads ahead land meanwhile: none may use this buffer
            assert np.array_equal(stage[:n], data[path][lo : lo + n]), j
            if j == 7:  # the first file's last window: the second file's are on their way
                assert [i for i, _ in ahead.pending] == [8, 9, 10]
                assert list(ahead.files) == [made[1][0]]  # the first one is closed
        assert len(seen) == sr.AHEAD + 1
    finally:
        ahead.close()
    assert not ahead.pending and not ahead.files


def test_a_file_whose_directory_refused_o_direct_is_read_straight_and_skipped_ahead(
    small, tmp_path
):
    made = files(tmp_path, [4 * WINDOW, 3 * WINDOW, 4 * WINDOW])
    direct.refuse_direct(os.path.dirname(made[1][0]), OSError(errno.EINVAL, "test"), "reads")
    plan = windows(made)
    ahead = sr._ReadAhead(plan)
    try:
        if not ahead.direct(0):
            pytest.skip("O_DIRECT refused here: nothing is read ahead")
        assert [ahead.direct(j) for j in range(len(plan))] == [True] * 4 + [False] * 3 + [True] * 4
        out = np.zeros(WINDOW, dtype=np.uint8)
        for j, (path, lo, n) in enumerate(plan):
            if ahead.direct(j):
                got, stage = ahead.take(j)
                piece = stage[:got]
            else:
                got = ahead.read_into(j, memoryview(out))
                piece = out[:got]
            assert got == n
            assert np.array_equal(piece, np.fromfile(path, dtype=np.uint8)[lo : lo + n]), j
            if j == 3:  # past the buffered file: the third file is read ahead already
                assert [i for i, _ in ahead.pending] == [7, 8, 9]
    finally:
        ahead.close()


def test_a_failed_read_ahead_is_raised_by_its_take_and_close_waits_for_the_rest(small, tmp_path):
    made = files(tmp_path, [6 * WINDOW])
    fault = faults.Fault("*.distcp", ops=("read",), error=OSError(5, "injected"))
    with faults.injected(fault):
        ahead = sr._ReadAhead(windows(made))
        try:
            if not ahead.direct(0):
                pytest.skip("O_DIRECT refused here: nothing is read ahead")
            with pytest.raises(OSError, match="injected"):
                ahead.take(0)
        finally:
            ahead.close()
    # the first take put at most AHEAD windows in flight, from the first on (those not
    # cancelled by `close` failed in the seam)
    offsets = sorted(c.offset for c in fault.calls)
    assert 1 <= len(offsets) <= sr.AHEAD
    assert offsets == [j * WINDOW for j in range(len(offsets))]
    assert all(c.direct for c in fault.calls)
    assert not ahead.pending and not ahead.files
