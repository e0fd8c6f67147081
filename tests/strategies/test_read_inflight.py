"""Several read requests in flight: exact bytes, per-request progress in order, errors, and
the page-cache residency check that keeps cached chunks off O_DIRECT."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.storage import direct, faults, inflight, probe
from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _slow_requests(monkeypatch, delay: float) -> list:
    """Makes each read request take `delay` s (a device serving it); returns a one-item
    list holding the most requests seen outstanding at once."""
    real = os.preadv
    busy, most = [0], [0]
    lock = threading.Lock()

    def slow_preadv(fd, bufs, offset, *flags):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(delay)
        try:
            return real(fd, bufs, offset, *flags)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(inflight.os, "preadv", slow_preadv)
    return most


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("offset,size,step", [(0, 50_000, 4096), (77, 12_345, 1000)])
def test_requests_in_flight_fill_exact_bytes_and_report_each_request_in_order(
    tmp_path, depth, offset, size, step
):
    data = os.urandom(offset + size + 100)
    (tmp_path / "f").write_bytes(data)
    out = np.zeros(size, dtype=np.uint8)
    seen: list = []

    def progress(filled: int) -> None:
        assert out[:filled].tobytes() == data[offset : offset + filled]  # in place when told
        seen.append(filled)

    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        inflight.read_in_flight(fd, offset, out, "f", progress, step, depth)
    finally:
        os.close(fd)
    assert out.tobytes() == data[offset : offset + size]
    assert seen == [min(size, s + step) for s in range(0, size, step)]


def test_several_requests_are_outstanding_at_once(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(os.urandom(64 * 1024))
    most = _slow_requests(monkeypatch, 0.02)
    out = np.zeros(64 * 1024, dtype=np.uint8)
    direct.read_region(str(tmp_path / "f"), 0, out, direct=False, request=4096, depth=4)
    assert out.tobytes() == (tmp_path / "f").read_bytes()
    assert most[0] == 4


def test_a_short_file_raises_after_every_started_request_finished(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(10_000))
    out = np.zeros(40_000, dtype=np.uint8)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorruptedError, match="short read"):
            inflight.read_in_flight(fd, 0, out, "f", None, 1000, 4)
    finally:
        os.close(fd)
    snapshot = out.copy()
    time.sleep(0.05)
    assert np.array_equal(out, snapshot)  # nothing writes into the destination afterwards


def test_a_progress_error_stops_the_read_and_propagates(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(40_000))
    out = np.zeros(40_000, dtype=np.uint8)

    def progress(filled: int) -> None:
        if filled >= 8000:
            raise CheckpointCorruptedError("damaged block")

    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorruptedError, match="damaged block"):
            inflight.read_in_flight(fd, 0, out, "f", progress, 1000, 4)
    finally:
        os.close(fd)


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("length", [40_960, 10_000 + 4096])  # whole slots; the file ends first
def test_slots_deliver_every_byte_in_file_order_with_requests_outstanding(
    tmp_path, monkeypatch, slots, length
):
    data = os.urandom(40_960)
    (tmp_path / "f").write_bytes(data)
    most = _slow_requests(monkeypatch, 0.01)
    buf = np.zeros(slots * 4096, dtype=np.uint8)
    views = [memoryview(buf)[i * 4096 : (i + 1) * 4096] for i in range(slots)]  # type: ignore[arg-type]
    got: list = []
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        inflight.read_through_slots(
            fd, 4096, length, views, lambda at, d: got.append((at, bytes(d)))
        )
    finally:
        os.close(fd)
    assert [at for at, _ in got] == list(range(4096, 4096 + len(got) * 4096, 4096))
    assert b"".join(d for _, d in got) == data[4096 : 4096 + length]
    assert most[0] == min(slots, -(-length // 4096))


def test_slots_stop_at_a_delivery_error_with_no_request_left_running(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(64 * 1024))
    buf = np.zeros(4 * 4096, dtype=np.uint8)
    views = [memoryview(buf)[i * 4096 : (i + 1) * 4096] for i in range(4)]  # type: ignore[arg-type]
    seen: list = []

    def deliver(at: int, data: memoryview) -> None:
        seen.append(at)
        if at >= 2 * 4096:
            raise CheckpointCorruptedError("damaged block")

    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorruptedError, match="damaged block"):
            inflight.read_through_slots(fd, 0, 64 * 1024, views, deliver)
    finally:
        os.close(fd)
    snapshot = buf.copy()
    time.sleep(0.05)
    assert seen == [0, 4096, 8192] and np.array_equal(buf, snapshot)


@pytest.mark.parametrize("slots,depth", [(4, 2), (5, 3), (8, 6), (3, 1)])
def test_slots_beyond_the_depth_take_requests_while_others_wait_to_be_delivered(
    tmp_path, monkeypatch, slots, depth
):
    """At most `depth` requests in flight; while the caller is still delivering the first
    request, the later ones fill every other slot, and none refills a slot whose bytes were
    not delivered yet."""
    data = os.urandom(24 * 4096)
    (tmp_path / "f").write_bytes(data)
    most = _slow_requests(monkeypatch, 0.005)
    buf = np.zeros(slots * 4096, dtype=np.uint8)
    views = [memoryview(buf)[i * 4096 : (i + 1) * 4096] for i in range(slots)]  # type: ignore[arg-type]
    started: list = []
    real_upto = inflight.read_upto

    def recording(fd, offset, view):
        started.append(offset)
        return real_upto(fd, offset, view)

    monkeypatch.setattr(inflight, "read_upto", recording)
    got: list = []
    during_first: list = []

    def deliver(at, view):
        if at == 0:  # a slow copy: the requests of every other slot are read meanwhile
            deadline = time.monotonic() + 5
            while len(started) < slots and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.03)  # long enough for a request into slot 0 to start, were it issued
            during_first.extend(started)
        got.append((at, bytes(view)))

    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert inflight.read_spans_through_slots(fd, [(0, len(data))], views, deliver, depth)
    finally:
        os.close(fd)
    assert b"".join(d for _, d in got) == data
    assert [at for at, _ in got] == list(range(0, len(data), 4096))
    assert most[0] == depth
    assert sorted(during_first) == [i * 4096 for i in range(slots)]


@pytest.mark.parametrize("size", [3 * (1 << 20) + 123, 5000])
def test_o_direct_into_an_unaligned_destination_goes_through_slots_bit_exactly(tmp_path, size):
    data = os.urandom(4 << 20)
    (tmp_path / "f").write_bytes(data)
    raw = np.zeros(size + 2 * 4096, dtype=np.uint8)
    out = raw[(-raw.ctypes.data) % 4096 + 64 :][:size]  # as torch places tensors
    filled: list = []
    direct.read_region(
        str(tmp_path / "f"), 777, out, direct=True, progress=filled.append, request=1 << 20
    )
    assert out.tobytes() == data[777 : 777 + size] and filled[-1] == size
    assert filled == sorted(filled)
    with pytest.raises(CheckpointCorruptedError, match="short read"):
        direct.read_region(str(tmp_path / "f"), (4 << 20) - 1000, out, direct=True)


@pytest.mark.parametrize("with_cachestat", [True, False])
def test_cached_tells_resident_regions_from_evicted_ones(tmp_path, monkeypatch, with_cachestat):
    if not with_cachestat:  # the RWF_NOWAIT samples of kernels before 6.5
        monkeypatch.setattr(probe, "cached_pages", lambda fd, offset, length: None)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    _evict(path)
    assert probe.cached(str(path), 0, 1 << 20) is False
    path.read_bytes()
    assert probe.cached(str(path), 0, 1 << 20) is True
    assert probe.cached(str(path), 0, 0) is False


def test_asking_whether_a_region_is_cached_reads_nothing_into_the_cache(tmp_path):
    # RWF_NOWAIT samples started readahead: under load, a cold 32 MiB chunk looked resident
    # to the check that followed (a CI failure), and was read through the page cache
    path = tmp_path / "f"
    path.write_bytes(os.urandom(32 << 20))
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if probe.cached_pages(fd, 0, 32 << 20) is None:
            pytest.skip("no cachestat(2) on this kernel")
        for _ in range(3):
            assert probe.cached(str(path), 4096, (32 << 20) - 4096) is False
        assert probe.cached_pages(fd, 0, 32 << 20) == 0
        os.pread(fd, 1 << 20, 0)
        assert probe.cached_pages(fd, 0, 32 << 20) >= (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def test_probe_prefers_o_direct_unless_the_page_cache_wins_in_total_and_in_half_the_pairs():
    assert probe.ReadProbe(1.0, 3.0, 1, ((0.5, 1.5), (0.5, 1.5))).prefer_direct
    assert probe.ReadProbe(1.0, 3.0, 1, ((0.1, 2.9), (0.9, 0.1))).prefer_direct
    # a tie (4 ranks x 4 GiB, where whole loads ran 1.9x as fast with O_DIRECT): O_DIRECT
    tie = ((0.053, 0.045), (0.042, 0.025), (0.053, 0.040), (0.023, 0.066))
    assert probe.ReadProbe(0.171, 0.176, 1, tie).prefer_direct
    assert probe.ReadProbe(0.95, 1.0, 1, ((0.45, 0.6), (0.5, 0.4))).prefer_direct
    # the page cache clearly faster in total and in both pairs: the page cache
    assert not probe.ReadProbe(3.0, 1.0, 1, ((1.5, 0.5), (1.5, 0.5))).prefer_direct
    # ... in total and in half of the pairs: the page cache
    half = ((1.0, 0.2), (1.0, 0.2), (0.5, 0.6), (0.5, 0.6))
    assert not probe.ReadProbe(3.0, 1.6, 1, half).prefer_direct
    # ... in total only through one outlying pair of three: O_DIRECT
    outlier = ((2.0, 0.01), (0.5, 1.0), (0.5, 1.0))
    assert probe.ReadProbe(3.0, 2.01, 1, outlier).prefer_direct
    # no pairs known: the totals decide
    assert not probe.ReadProbe(1.0, 0.1, 1).prefer_direct
    assert probe.ReadProbe(0.1, 1.0, 1).prefer_direct


@pytest.mark.parametrize("resident", [False, True])
def test_a_chunk_in_the_page_cache_is_read_from_it_even_where_o_direct_measured_faster(
    tmp_path, monkeypatch, resident
):
    w = torch.randn(4096, 2048)  # 32 MiB: larger than the readahead of the header read
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    monkeypatch.setattr(
        probe,
        "_measure",
        lambda path, pairs=2, direct_first=True: probe.ReadProbe(
            0.1, 1.0, 1, ((0.05, 0.5), (0.05, 0.5))
        ),
    )
    for f in (tmp_path / "c").glob("*.distcp"):
        _evict(f)
        if resident:
            f.read_bytes()
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}
    with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
        got = dc.load(req, tmp_path / "c", sharded_strategy=TorchDistLoadShardedStrategy())
    assert torch.equal(got["w"], w)
    assert [c.direct for c in spy.calls] == [not resident]


@pytest.mark.parametrize("use_direct", [False, True])
def test_read_region_keeps_one_request_in_flight_through_the_page_cache_and_more_with_o_direct(
    tmp_path, monkeypatch, use_direct
):
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    depths: list = []
    real = direct.read_in_flight

    def spy(fd, offset, out, path, progress, request, depth):
        depths.append(depth)
        return real(fd, offset, out, path, progress, request, depth)

    monkeypatch.setattr(direct, "read_in_flight", spy)
    out = np.frombuffer(mmap.mmap(-1, 1 << 20), dtype=np.uint8)  # page-aligned
    direct.read_region(str(tmp_path / "f"), 0, out, use_direct)
    assert out.tobytes() == data
    if use_direct and not direct.direct_allowed(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    assert depths == [inflight.DEPTH if use_direct else direct.BUFFERED_DEPTH]
    assert direct.BUFFERED_DEPTH == 1 < inflight.DEPTH


def _three_file_checkpoint(tmp_path):
    """6 tensors in 3 data files, two each (one process writing with 3 threads)."""
    from dist_checkpointing.strategies.torch_dist import TorchDistSaveShardedStrategy

    ws = [torch.randn(64, 256) for _ in range(6)]
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", w) for i, w in enumerate(ws)}
    dc.save(sd, tmp_path / "c", TorchDistSaveShardedStrategy(thread_count=3))
    assert len(list((tmp_path / "c").glob("*.distcp"))) == 3
    return ws


@pytest.fixture
def data_reads(monkeypatch):
    """`(thread name, file name, offset)` of every data-file read request, in order."""
    calls: list = []
    real = faults.check

    def check(op, path, offset, nbytes, use_direct):
        if op == "read" and path.endswith(".distcp"):
            calls.append((threading.current_thread().name, os.path.basename(path), offset))
        return real(op, path, offset, nbytes, use_direct)

    monkeypatch.setattr(faults, "check", check)
    return calls


@pytest.mark.parametrize("first_file", [0, 1, 5])
def test_each_file_is_read_front_to_back_starting_at_first_file(tmp_path, data_reads, first_file):
    from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
    from dist_checkpointing.strategies.torch_dist.plan import TensorRequest, plan_tensor_reads
    from dist_checkpointing.strategies.torch_dist.reader import read_tensor_items

    ws = _three_file_checkpoint(tmp_path)
    ckpt = tmp_path / "c"
    md = read_metadata(ckpt)
    dests = [torch.zeros_like(w) for w in ws]
    reads = []
    for i, w in enumerate(ws):
        req = TensorRequest(f"w{i}", i, (0, 0), tuple(w.shape))
        reads += plan_tensor_reads(req, md.state_dict_metadata[f"w{i}"])
    read_tensor_items(
        ckpt, md, reads, lambda r: dests[r.dest_index.index], thread_count=1, first_file=first_file
    )
    assert all(torch.equal(d, w) for d, w in zip(dests, ws))
    names = sorted(p.name for p in ckpt.glob("*.distcp"))
    k = first_file % 3
    files = [f for _, f, _ in data_reads]
    # whole files one after another, from the rotated start, each in file order
    assert [f for i, f in enumerate(files) if i == 0 or f != files[i - 1]] == names[k:] + names[:k]
    for name in names:
        offsets = [o for _, f, o in data_reads if f == name]
        assert offsets == sorted(offsets)


def test_files_are_read_in_parallel_each_by_a_single_thread(tmp_path, data_reads):
    ws = _three_file_checkpoint(tmp_path)
    req = {
        f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.zeros_like(w))
        for i, w in enumerate(ws)
    }
    with faults.injected(faults.Fault("*.distcp", ops=("read",), delay_s=0.05)):  # a slow disk
        got = dc.load(req, tmp_path / "c", TorchDistLoadShardedStrategy(thread_count=2))
    assert all(torch.equal(got[f"w{i}"], w) for i, w in enumerate(ws))
    by_file: dict = {}
    for thread, name, offset in data_reads:
        by_file.setdefault(name, []).append((thread, offset))
    assert len(by_file) == 3
    for seen in by_file.values():
        assert len({t for t, _ in seen}) == 1  # a file is never split between threads
        assert [o for _, o in seen] == sorted(o for _, o in seen)
    assert len({t for t, _, _ in data_reads}) == 2
