"""The sync save's write path: the O_DIRECT / page-cache probe, and buffered streaming."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.storage import FileWriter, direct, segments, write_probe
from dist_checkpointing.storage.write_probe import WriteProbe
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.strategies.test_disk_io import _refuse_o_direct


@pytest.mark.parametrize(
    "pairs, direct_wins",
    [
        (((1.0, 0.5), (1.0, 0.5)), False),  # buffered clearly faster every time
        (((1.0, 0.5), (1.0, 0.95)), True),  # one pair within the margin: noise, keep O_DIRECT
        (((1.0, 0.2), (0.3, 1.0)), True),  # faster in total, slower in one pair
        (((1.0, 1.0), (1.0, 1.0)), True),  # a tie keeps O_DIRECT (less CPU)
        (((0.5, 1.0), (0.5, 1.0)), True),
        ((), True),  # nothing measured
    ],
)
def test_write_probe_prefers_o_direct_unless_buffered_is_clearly_faster_in_every_pair(
    pairs, direct_wins
):
    assert WriteProbe(pairs, 1 << 20).prefer_direct is direct_wins


def test_write_probe_measures_once_per_file_system_and_leaves_no_file(tmp_path, monkeypatch):
    calls = []
    real = write_probe._measure

    def counting(d):
        calls.append(d)
        return real(d)

    monkeypatch.setattr(write_probe, "_measure", counting)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_probe.prefer_direct_writes(tmp_path / "a", 1 << 30)
    second = write_probe.prefer_direct_writes(tmp_path / "b", 1 << 30)
    assert first == second and len(calls) == 1
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []
    result = write_probe.write_probe_result(tmp_path / "b")
    assert result is not None and len(result.pairs) == write_probe.ROUNDS
    assert all(d > 0 and b > 0 for d, b in result.pairs)


def test_write_probe_is_skipped_for_small_saves_until_a_large_one_measured(tmp_path, monkeypatch):
    measured = WriteProbe(((1.0, 0.1), (1.0, 0.1)), 1 << 20)
    monkeypatch.setattr(write_probe, "_measure", lambda d: measured)
    small = write_probe.MIN_PROBED_SAVE - 1
    assert write_probe.prefer_direct_writes(tmp_path, small) is True
    assert write_probe.write_probe_result(tmp_path) is None
    assert write_probe.prefer_direct_writes(tmp_path, write_probe.MIN_PROBED_SAVE) is False
    assert write_probe.prefer_direct_writes(tmp_path, small) is False  # the kept measurement


def test_write_probe_chooses_buffered_where_o_direct_is_refused(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch)
    assert write_probe.prefer_direct_writes(tmp_path, 1 << 30) is False
    assert not direct.direct_allowed(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_buffered_stream_writes_the_exact_bytes_and_starts_writeback_of_all_of_them(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(segments, "CHUNK", 1000)
    monkeypatch.setattr(segments.BufferedStream, "WRITEBACK", 2500)
    started = []
    monkeypatch.setattr(
        segments, "start_writeback", lambda fd, off, n: started.append((off, n)) if n else None
    )
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 7, 3000, 1, 999, 4096)]
    want = np.concatenate(pieces)
    out = FileWriter(tmp_path / "f", want.size, direct=False, preallocate=False)
    stream = segments.BufferedStream(out)
    seen = []
    for p in pieces:
        stream.put(p, seen.append)
    stream.finish()
    stream.close()
    out.finish()
    assert (tmp_path / "f").read_bytes() == want.tobytes()
    assert b"".join(s.tobytes() for s in seen) == want.tobytes()
    assert max(s.size for s in seen) <= 1000
    pos = 0
    for off, n in started:  # contiguous ranges covering the file
        assert off == pos
        pos += n
    assert pos == want.size and len(started) > 1


def test_buffered_stream_refuses_device_tensors(tmp_path):
    out = FileWriter(tmp_path / "f", 4, direct=False)
    try:
        with pytest.raises(TypeError):
            segments.BufferedStream(out).put(torch.zeros(4, dtype=torch.uint8))
    finally:
        out.abort(remove=True)


def _spy_writers(monkeypatch):
    opened = []
    real_init = FileWriter.__init__

    def init(self, path, size, direct, *args, **kwargs):
        real_init(self, path, size, direct, *args, **kwargs)
        if str(path).endswith(".distcp"):
            opened.append(self.direct)

    monkeypatch.setattr(FileWriter, "__init__", init)
    return opened


@pytest.mark.parametrize(
    "probe_says_direct, direct_io, expect_direct",
    [(False, None, False), (True, None, True), (False, True, True), (True, False, False)],
)
def test_sync_save_writes_the_way_the_probe_or_the_caller_chose_and_loads_bit_exactly(
    tmp_path, monkeypatch, probe_says_direct, direct_io, expect_direct
):
    pair = (0.1, 1.0) if probe_says_direct else (1.0, 0.1)
    monkeypatch.setattr(write_probe, "_measure", lambda d: WriteProbe((pair, pair), 1 << 20))
    monkeypatch.setattr(write_probe, "MIN_PROBED_SAVE", 0)
    opened = _spy_writers(monkeypatch)
    sd = {
        "big": torch.randn(1100, 300),  # over 1 MiB: data on a 4096-byte offset
        "odd": torch.arange(0, 777, dtype=torch.int16),
        "empty": torch.zeros(0, 5),
        "strided": torch.randn(40, 60).t(),
    }
    strategy = TorchDistSaveShardedStrategy(thread_count=2, direct_io=direct_io)
    dc.save(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in sd.items()},
        tmp_path / "c",
        sharded_strategy=strategy,
    )
    assert opened and all(d is expect_direct for d in opened), opened
    assert write_probe.write_probe_result(tmp_path / "c") is not None or direct_io is not None
    req = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in sd.items()}
    got = dc.load(req, tmp_path / "c")  # checksums are verified by default
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


def test_chunk_stream_into_a_buffered_file_starts_writeback_of_each_chunk(tmp_path, monkeypatch):
    """The path of CUDA sources when the probe chose the page cache (no CUDA needed)."""
    started = []
    monkeypatch.setattr(segments, "start_writeback", lambda fd, off, n: started.append((off, n)))
    data = np.random.default_rng(1).integers(0, 256, segments.CHUNK + 5000, dtype=np.uint8)
    out = FileWriter(tmp_path / "f", data.size, direct=False, preallocate=False)
    stream = segments.ChunkStream(out)
    try:
        stream.put(data)
        stream.finish()
    finally:
        stream.close()
    out.finish()
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    assert [off for off, _ in started] == [0, segments.CHUNK]
    assert started[0][1] == segments.CHUNK and started[1][1] >= 5000


def test_sync_save_measures_its_write_path_whatever_the_cores_per_rank(tmp_path, monkeypatch):
    # a former rule wrote buffered without measuring where the node had fewer cores than
    # ranks; on a later day's disk that was 2x slower than O_DIRECT (README, "Disk-speed I/O")
    from dist_checkpointing.storage import threads

    monkeypatch.setattr(threads, "cores_per_local_rank", lambda cuda, *a, **k: 0.5)
    monkeypatch.setattr(write_probe, "MIN_PROBED_SAVE", 0)
    measured: list = []
    slow_buffered = WriteProbe(((0.1, 1.0),) * write_probe.ROUNDS, 1 << 20)
    monkeypatch.setattr(write_probe, "_measure", lambda d: measured.append(d) or slow_buffered)
    opened = _spy_writers(monkeypatch)
    w = torch.randn(700, 500)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    assert opened == [True] and len(measured) == 1
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}, tmp_path / "c")
    assert torch.equal(got["w"], w)


@pytest.mark.parametrize(
    "pairs_per_rank, direct",
    [
        ([((1.0, 0.5),), ((1.0, 0.5),)], False),  # buffered clearly faster everywhere
        ([((1.0, 0.5),), ((1.0, 0.95),)], True),  # within the margin on one rank
        ([((1.0, 0.5),), ((0.5, 1.0),)], True),  # O_DIRECT faster on one rank
        ([((1.0, 0.5),), None], False),  # a rank that did not measure has no say
        ([None, None], None),  # nobody measured
    ],
)
def test_combined_write_probes_choose_the_page_cache_only_if_every_rank_measured_it_faster(
    pairs_per_rank, direct
):
    probes = [None if p is None else WriteProbe(p, 1 << 20) for p in pairs_per_rank]
    got = write_probe.combine(probes)
    if direct is None:
        assert got is None
    else:
        assert got is not None and got.prefer_direct is direct
        assert len(got.pairs) == sum(len(p) for p in pairs_per_rank if p is not None)


def test_a_kept_agreement_is_used_and_a_rank_contributes_only_its_own_probe(tmp_path, monkeypatch):
    own = WriteProbe(((1.0, 0.5),) * write_probe.ROUNDS, 1 << 20)  # buffered faster here
    monkeypatch.setattr(write_probe, "_measure", lambda d: own)
    assert write_probe.local_write_probe(tmp_path, 1 << 30) is own
    assert write_probe.prefer_direct_writes(tmp_path, 1 << 30) is False
    other = WriteProbe(((0.5, 1.0),), 1 << 20)  # another rank: O_DIRECT faster
    agreed = write_probe.combine([own, other])
    assert agreed is not None
    write_probe.keep(tmp_path, agreed)
    assert write_probe.prefer_direct_writes(tmp_path, 1 << 30) is True
    assert write_probe.write_probe_result(tmp_path) == agreed
    assert write_probe.local_write_probe(tmp_path, 1 << 30) is own  # not the combination
