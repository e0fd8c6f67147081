"""The load's read paths: measured choice of page cache or O_DIRECT, verification as bytes land,
corruption found on every path, bounded extra memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor, integrity
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.storage import buffers, direct, faults, probe
from dist_checkpointing.strategies.torch_dist import reader, verify, zipformat
from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
from dist_checkpointing.strategies.torch_dist.reader import open_range
from dist_checkpointing.strategies.torch_dist.zipformat import chunk_layout
from tests._sharding import row_block


def _fixed_probe(monkeypatch, direct_faster: bool) -> list:
    measured: list = []

    def measure(path: str, pairs: int = 2, direct_first: bool = True) -> probe.ReadProbe:
        measured.append(path)
        return probe.ReadProbe(0.1 if direct_faster else 1.0, 1.0 if direct_faster else 0.1, 1)

    monkeypatch.setattr(probe, "_measure", measure)
    return measured


@pytest.mark.parametrize("use_direct", [False, True])
@pytest.mark.parametrize("offset,size,aligned", [(0, 5 * 4096, True), (123, 20_000, False)])
def test_read_region_reports_increasing_progress_up_to_the_size(
    tmp_path, use_direct, offset, size, aligned
):
    import mmap

    data = os.urandom(8 * 4096)
    (tmp_path / "f").write_bytes(data)
    if aligned:
        out = np.frombuffer(mmap.mmap(-1, 8 * 4096), dtype=np.uint8)[:size]
    else:
        out = np.zeros(size, dtype=np.uint8)
    seen: list = []

    def progress(filled: int) -> None:
        # the bytes reported are in place when reported
        assert out[:filled].tobytes() == data[offset : offset + filled]
        seen.append(filled)

    direct.read_region(
        str(tmp_path / "f"), offset, out, direct=use_direct, progress=progress, request=4096
    )
    assert out.tobytes() == data[offset : offset + size]
    assert seen == sorted(seen) and seen[-1] == size and len(seen) > 1


def test_probe_measures_once_per_file_system_and_picks_the_faster_path(tmp_path, monkeypatch):
    path = tmp_path / "big"
    path.write_bytes(os.urandom(4 * probe.PROBE_BYTES + 8192))
    real = probe._measure(str(path))  # the real measurement reads both ways
    assert real is not None and real.direct_s > 0 and real.buffered_s > 0
    (tmp_path / "small").write_bytes(b"x" * 100)
    assert probe._measure(str(tmp_path / "small")) is None  # too small to measure
    assert probe.prefer_direct_reads(str(tmp_path / "small")) is False
    assert probe.probe_result(str(tmp_path / "small")) is None  # and nothing remembered

    measured = _fixed_probe(monkeypatch, direct_faster=True)
    assert probe.prefer_direct_reads(str(path)) is True
    assert probe.prefer_direct_reads(str(path)) is True
    assert len(measured) == 1  # remembered for the file system
    probe.forget_probes()
    measured = _fixed_probe(monkeypatch, direct_faster=False)
    assert probe.prefer_direct_reads(str(path)) is False
    assert probe.probe_result(str(path)) is not None


def test_probe_times_each_path_as_loads_read_into_tensors(tmp_path, monkeypatch):
    # raw O_DIRECT requests into aligned memory won a probe where whole loads, which reach
    # torch's (64-byte aligned) tensors through a bounce buffer, were slower than the page cache
    path = tmp_path / "big"
    path.write_bytes(os.urandom(4 * probe.PROBE_BYTES + 8192))
    calls: list = []

    def recording(name, real):
        def call(fd, offset, out, *args):
            calls.append((name, out.ctypes.data % 512, out.size))
            return real(fd, offset, out, *args)

        return call

    monkeypatch.setattr(probe, "_direct", recording("direct", probe._direct))
    monkeypatch.setattr(probe, "_buffered", recording("buffered", probe._buffered))
    result = probe._measure(str(path))
    assert result is not None and len(result.pairs) == 2
    assert [c[0] for c in calls] == ["direct", "buffered"] * 2
    assert all(misaligned != 0 and size == probe.PROBE_BYTES for _, misaligned, size in calls)
    calls.clear()  # one pair (what each rank of a multi-rank load reads): half the bytes
    one = probe._measure(str(path), pairs=1)
    assert one is not None and len(one.pairs) == 1 and one.nbytes == probe.PROBE_BYTES
    assert [c[0] for c in calls] == ["direct", "buffered"]
    calls.clear()  # the odd ranks' order; the pairs still read (O_DIRECT, page cache)
    clock = [0.0]

    def timed(real, cost):  # around the recording readers above
        def call(*args):
            clock[0] += cost
            return real(*args)

        return call

    monkeypatch.setattr(probe, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(probe, "_direct", timed(probe._direct, 1.0))
    monkeypatch.setattr(probe, "_buffered", timed(probe._buffered, 10.0))
    flipped = probe._measure(str(path), pairs=2, direct_first=False)
    assert [c[0] for c in calls] == ["buffered", "direct"] * 2
    assert flipped is not None and flipped.pairs == ((1.0, 10.0), (1.0, 10.0))


def test_ranks_alternate_which_path_their_probe_reads_first(tmp_path, monkeypatch):
    from dist_checkpointing.strategies.torch_dist import load as load_mod

    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    seen = []
    monkeypatch.setattr(
        probe, "local_probe", lambda path, pairs, direct_first: seen.append((pairs, direct_first))
    )
    monkeypatch.setattr(load_mod, "get_world_size", lambda: 4)
    for r in range(4):
        monkeypatch.setattr(load_mod, "get_rank", lambda r=r: r)
        load_mod._measure_read_path(tmp_path)
    assert seen == [(1, True), (1, False), (1, True), (1, False)]


def test_probe_times_o_direct_with_its_bounce_buffer_already_made(tmp_path, monkeypatch):
    # a load finds its bounce buffer pooled; the probe must not time making one (its page
    # faults) against O_DIRECT, in the only pair a rank of a multi-rank load measures
    path = tmp_path / "big"
    path.write_bytes(os.urandom(4 * probe.PROBE_BYTES + 8192))
    monkeypatch.setattr(buffers, "_free_bounce", [])
    pooled_at_read: list = []
    real = probe._direct

    def direct_read(*args):
        pooled_at_read.append(len(buffers._free_bounce))
        return real(*args)

    monkeypatch.setattr(probe, "_direct", direct_read)
    one = probe._measure(str(path), pairs=1)
    assert one is not None and len(one.pairs) == 1
    assert pooled_at_read == [1]


def test_probe_is_skipped_where_o_direct_was_refused(tmp_path, monkeypatch):
    path = tmp_path / "big"
    path.write_bytes(b"\0" * (4 * probe.PROBE_BYTES + 8192))
    measured = _fixed_probe(monkeypatch, direct_faster=True)
    direct.refuse_direct(str(tmp_path), OSError(22, "refused"), "reads")
    assert probe.prefer_direct_reads(str(path)) is False and measured == []


@pytest.mark.parametrize("direct_faster", [False, True])
def test_whole_chunk_loads_take_the_measured_read_path(tmp_path, monkeypatch, direct_faster):
    # 32 MiB: reading the chunk's head starts the kernel's readahead, which made all of a
    # 1 MiB chunk resident before the residency check (then read from the page cache)
    w = torch.randn(8192, 1024)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    for f in (tmp_path / "c").glob("*.distcp"):  # out of the page cache, whichever path the
        fd = os.open(f, os.O_RDONLY)  # save's writes took
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    measured = _fixed_probe(monkeypatch, direct_faster)
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}
    with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
        got = dc.load(req, tmp_path / "c", sharded_strategy=TorchDistLoadShardedStrategy())
    assert torch.equal(got["w"], w) and len(measured) == 1
    if direct_faster:  # one aligned stream of the item: its records and data together
        assert [c.direct for c in spy.calls] == [True]
        assert w.numel() * 4 < spy.calls[0].nbytes < w.numel() * 4 + 64 * 1024
    else:
        assert [(c.nbytes, c.direct) for c in spy.calls] == [(w.numel() * 4, False)]


def _save_blocked(tmp_path, monkeypatch, w: torch.Tensor) -> None:
    # small checksum blocks: many blocks per item, so request-by-request checks are exercised
    monkeypatch.setattr(integrity, "BLOCK", 4096)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")


def _data_offset(ckpt) -> tuple:
    md = read_metadata(ckpt)
    (info,) = [i for k, i in md.storage_data.items() if k.fqn == "w"]
    path = ckpt / info.relative_path
    with open_range(path, info) as f:
        layout = chunk_layout(f.raw)
    return path, info.offset + layout.data_offset


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# (requests of this load, direct_io): every way a chunk's data is read
PATHS = {
    "whole chunk, page cache": (lambda w: [(0, w.shape[0])], False),
    "whole chunk, O_DIRECT": (lambda w: [(0, w.shape[0])], True),
    "whole chunk, measured": (lambda w: [(0, w.shape[0])], None),
    "whole chunk shared by two requests": (lambda w: [(0, 100), (100, w.shape[0] - 100)], None),
    "rows of a chunk (resharded), measured": (lambda w: [(40, 90)], None),
    "rows of a chunk (resharded), O_DIRECT": (lambda w: [(40, 90)], True),
    "rows of a chunk (resharded), page cache": (lambda w: [(40, 90)], False),
    "rows of a chunk from the first row": (lambda w: [(0, 90)], True),
    "rows of a chunk to the last row": (lambda w: [(40, w.shape[0])], True),
    "two parts of a chunk (scattered)": (lambda w: [(40, 60), (60, 90)], None),
}


def _request(w: torch.Tensor, rows: list) -> dict:
    return {f"p{i}": row_block("w", w, r0, r1) for i, (r0, r1) in enumerate(rows)}


@pytest.mark.parametrize("path_name", list(PATHS))
def test_every_read_path_loads_exact_bytes_and_finds_a_damaged_block(
    tmp_path, monkeypatch, path_name
):
    rows, direct_io = PATHS[path_name]
    _fixed_probe(monkeypatch, direct_faster=True)
    monkeypatch.setattr(reader, "READ_REQUEST", 3 * 4096)  # several requests per chunk
    monkeypatch.setattr(reader, "STREAM_REQUEST", 3 * 4096)
    w = torch.randn(200, 1000)  # 4000-byte rows: blocks and rows never line up
    _save_blocked(tmp_path, monkeypatch, w)
    strategy = TorchDistLoadShardedStrategy(direct_io=direct_io)
    ckpt = tmp_path / "c"
    got = dc.load(
        _request(w, rows(w)), ckpt, sharded_strategy=strategy, validate_access_integrity=False
    )
    for i, (r0, r1) in enumerate(rows(w)):
        assert torch.equal(got[f"p{i}"], w[r0:r1])

    path, data0 = _data_offset(ckpt)
    bad = 55 * 4000 + 17  # a byte of row 55, in block 53 of the data
    _flip(path, data0 + bad)
    block = bad // 4096
    lo = data0 + block * 4096
    with pytest.raises(CheckpointCorruptedError, match=f"bytes {lo}-{lo + 4096} of"):
        dc.load(
            _request(w, rows(w)), ckpt, sharded_strategy=strategy, validate_access_integrity=False
        )


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("where", ["before the rows", "after the rows"])
def test_rows_read_in_place_find_damage_in_their_edge_blocks_outside_the_rows(
    tmp_path, monkeypatch, direct_io, where
):
    # rows 40-90 are data bytes 160000-360000: their first block (39) starts 256 bytes
    # before them and their last (87) ends 448 bytes after them; those bytes are read only
    # to verify the blocks, and their damage must still be found
    monkeypatch.setattr(reader, "READ_REQUEST", 3 * 4096)
    monkeypatch.setattr(reader, "STREAM_REQUEST", 3 * 4096)
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    path, data0 = _data_offset(tmp_path / "c")
    strategy = TorchDistLoadShardedStrategy(direct_io=direct_io)
    ok = dc.load(
        _request(w, [(40, 90)]),
        tmp_path / "c",
        sharded_strategy=strategy,
        validate_access_integrity=False,
    )
    assert torch.equal(ok["p0"], w[40:90])
    bad = 159800 if where == "before the rows" else 360100
    _flip(path, data0 + bad)
    lo = data0 + bad // 4096 * 4096
    with pytest.raises(CheckpointCorruptedError, match=f"bytes {lo}-{lo + 4096} of"):
        dc.load(
            _request(w, [(40, 90)]),
            tmp_path / "c",
            sharded_strategy=strategy,
            validate_access_integrity=False,
        )


def test_damage_outside_the_requested_rows_is_not_read(tmp_path, monkeypatch):
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    path, data0 = _data_offset(tmp_path / "c")
    _flip(path, data0 + 190 * 4000)
    got = dc.load(_request(w, [(0, 50)]), tmp_path / "c", validate_access_integrity=False)
    assert torch.equal(got["p0"], w[:50])


def test_verification_runs_request_by_request_never_as_a_second_pass(tmp_path, monkeypatch):
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    monkeypatch.setattr(reader, "READ_REQUEST", 2 * 4096)
    monkeypatch.setattr(reader, "STREAM_REQUEST", 2 * 4096)
    hashed: list = []
    real = integrity.ItemSum.bad_block

    def spy(self, data, start):
        hashed.append((start, len(data)))
        return real(self, data, start)

    monkeypatch.setattr(integrity.ItemSum, "bad_block", spy)
    # O_DIRECT loads are streamed (`stream`): each delivered piece is hashed as it is copied
    real_feed = verify.BlockCheck.feed

    def spy_feed(self, view):
        hashed.append((self.k * self.block + self.filled, len(view)))
        return real_feed(self, view)

    monkeypatch.setattr(verify.BlockCheck, "feed", spy_feed)
    for direct_io in (False, True):
        hashed.clear()
        got = dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))},
            tmp_path / "c",
            sharded_strategy=TorchDistLoadShardedStrategy(direct_io=direct_io),
        )
        assert torch.equal(got["w"], w)
        # each request's blocks once, in order, covering the data exactly once
        assert all(n <= 2 * 4096 for _, n in hashed[:-1]), hashed
        assert [s for s, _ in hashed] == sorted({s for s, _ in hashed})
        assert sum(n for _, n in hashed) == w.numel() * 4


_MEMORY_CHILD = textwrap.dedent(
    """
    import os, resource, sys, torch
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy

    ckpt, n, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    half = cols // 2
    # a resharded load (column halves of row-major chunks: every read is partial)
    req = {
        f"t{i}": ShardedTensor(f"t{i}", torch.ones(rows, half), torch.float32, (rows, half),
                               (rows, cols), (0, half), None)
        for i in range(n)
    }
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    # the read-path probe fills its own destination once per process and file system (the
    # README counts it apart): measured before the baseline
    from dist_checkpointing.storage import probe
    probe.local_probe(os.path.join(ckpt, sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))[0]))
    before = hwm()
    got = dc.load(req, ckpt, sharded_strategy=TorchDistLoadShardedStrategy(thread_count=2),
                  validate_access_integrity=False)
    assert all(bool((got[f"t{i}"][:, 0] == i).all()) for i in range(n))
    print(hwm() - before)
    """
)


@pytest.mark.timeout(300)
def test_resharded_load_larger_than_the_memory_bound_stays_within_it(tmp_path):
    # 12 stored chunks of 16 MiB (192 MiB read, half of each chunk needed): the README's bound
    # is the rank's tensors (allocated before measuring) plus, per reading thread, the needed
    # rows of one stored chunk (here all rows: 16 MiB) and two checksum blocks.
    n, rows, cols = 12, 4096, 1024
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((rows, cols), float(i)))
        for i in range(n)
    }
    dc.save(sd, tmp_path / "c")
    del sd
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(tmp_path / "c"), str(n), str(rows), str(cols)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=True,
    )
    extra = int(out.stdout.split()[-1])
    chunk = rows * cols * 4
    bound = 2 * (chunk + 2 * integrity.BLOCK)
    assert n * chunk > 3 * bound  # the load is well larger than the bound
    assert extra <= bound + (16 << 20), f"{extra >> 20} MiB beyond the tensors"


def test_resharded_rows_reach_their_destinations_request_by_request():
    # a chunk's rows 2..9 were read into `stored` (the region starts 8 bytes before row 2);
    # two reads need rows 2..5 (columns 1..3) and 5..9
    stored = torch.arange(100, dtype=torch.float32).view(10, 10)
    region = torch.cat([torch.zeros(2), stored[2:10].reshape(-1)])
    rows = region[2:].view(8, 10)
    a, b = torch.zeros(3, 2), torch.zeros(4, 10)
    pairs = [(rows[0:3, 1:3], a, 2), (rows[3:7], b, 5)]
    scatter = reader._Scatter(pairs, 2, 8, 40, 8)
    scatter(8 + 40 * 2 + 5)  # two whole rows ready (and part of a third)
    assert torch.equal(a[:2], stored[2:4, 1:3]) and not a[2].any() and not b.any()
    scatter(8 + 40 * 8)
    assert torch.equal(a, stored[2:5, 1:3]) and torch.equal(b, stored[5:9])


def test_head_layout_locates_the_data_from_the_records_before_it():
    layout = zipformat.zip_item_layout(torch.bfloat16, (3, 5000), 12345)
    assert layout is not None
    n = len(layout.head)
    got = zipformat.head_layout(layout.head, n, layout.data_nbytes)
    assert got == zipformat.ChunkLayout(n, torch.bfloat16, (3, 5000))
    assert zipformat.head_layout(layout.head[:100], 100, layout.data_nbytes) is None  # cut pickle
    assert zipformat.head_layout(layout.head, n + 1, layout.data_nbytes) is None
    assert zipformat.head_layout(layout.head, n, layout.data_nbytes + 2) is None
    assert zipformat.head_layout(b"\0" * n, n, layout.data_nbytes) is None


def test_checksummed_chunks_are_read_front_to_back(tmp_path, monkeypatch):
    """The zip directory at an item's end is not read before its data (a random read per
    chunk): the layout comes from the records before the data, the tail is checked after."""
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    ckpt = tmp_path / "c"
    path, data0 = _data_offset(ckpt)

    def no_directory(item):
        raise AssertionError("the directory was parsed")

    monkeypatch.setattr(reader, "chunk_layout", no_directory)
    with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
        got = dc.load(_request(w, [(0, 200)]), ckpt, validate_access_integrity=False)
    assert torch.equal(got["p0"], w)
    assert spy.calls and spy.calls[0].offset == data0
    # without checksums there is no recorded data offset: the directory is parsed
    with pytest.raises(Exception, match="directory was parsed"):
        dc.load(
            _request(w, [(0, 200)]),
            ckpt,
            sharded_strategy=TorchDistLoadShardedStrategy(verify_checksums=False),
            validate_access_integrity=False,
        )


@pytest.mark.parametrize("where", ["pickle", "directory"])
@pytest.mark.parametrize("rows", [(0, 200), (40, 90)])
def test_damaged_zip_records_are_found_after_a_front_to_back_read(
    tmp_path, monkeypatch, where, rows
):
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    ckpt = tmp_path / "c"
    md = read_metadata(ckpt)
    (info,) = [i for k, i in md.storage_data.items() if k.fqn == "w"]
    path, data0 = _data_offset(ckpt)
    data = open(path, "rb").read()
    if where == "pickle":  # the stored shape's first digit: 200 -> a different shape
        at = data.index(b"K\xc8", info.offset, data0)  # BININT1 200
        _flip(path, at + 1)
    else:
        _flip(path, info.offset + info.length - 30)
    with pytest.raises(CheckpointCorruptedError, match="w"):
        dc.load(_request(w, [rows]), ckpt, validate_access_integrity=False)


def test_combined_probes_decide_over_every_ranks_pairs():
    win = probe.ReadProbe(0.2, 2.0, 8, ((0.1, 1.0), (0.1, 1.0)))
    lose = probe.ReadProbe(2.0, 0.2, 8, ((1.0, 0.1), (1.0, 0.1)))
    mixed = probe.ReadProbe(1.1, 0.2, 8, ((0.1, 0.1), (1.0, 0.1)))  # loses both pairs
    both = probe.combine([win, win])
    assert both is not None and both.prefer_direct
    assert len(both.pairs) == 4 and both.nbytes == 16 and both.direct_s == pytest.approx(0.4)
    # a tie in total (one rank's pairs each way): O_DIRECT
    assert probe.combine([win, lose]).prefer_direct  # type: ignore[union-attr]
    assert not probe.combine([lose, lose]).prefer_direct  # type: ignore[union-attr]
    # half the pairs won and 0.59x in total: O_DIRECT
    assert probe.combine([win, mixed]).prefer_direct  # type: ignore[union-attr]
    # the page cache far ahead in total through one rank's pairs, behind on the two
    # others: O_DIRECT (one rank's outlying pairs do not decide alone)
    outlier = probe.ReadProbe(4.0, 0.02, 8, ((2.0, 0.01), (2.0, 0.01)))
    slight = probe.ReadProbe(0.2, 0.4, 8, ((0.1, 0.2), (0.1, 0.2)))
    assert probe.combine([outlier, slight, slight]).prefer_direct  # type: ignore[union-attr]
    assert not probe.combine([outlier, slight]).prefer_direct  # type: ignore[union-attr]
    assert probe.combine([None, win]).prefer_direct  # type: ignore[union-attr]
    assert probe.combine([None, None]) is None and probe.combine([]) is None


def test_a_load_measures_once_and_keeps_the_same_result_across_loads(tmp_path, monkeypatch):
    measured: list = []

    def measure(path: str, pairs: int = 2, direct_first: bool = True) -> probe.ReadProbe:
        measured.append(path)
        return probe.ReadProbe(0.2, 2.0, 8, ((0.1, 1.0), (0.1, 1.0)))

    monkeypatch.setattr(probe, "_measure", measure)
    w = torch.randn(64, 8)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    for _ in range(3):
        out = dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8))}, tmp_path / "c"
        )
        assert torch.equal(out["w"], w)
    assert len(measured) == 1
    data = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    kept = probe.probe_result(str(data))
    assert kept is not None and kept.prefer_direct and len(kept.pairs) == 2  # no growth


def test_a_file_too_small_to_probe_leaves_the_file_system_to_a_later_larger_one(
    tmp_path, monkeypatch
):
    (tmp_path / "small").write_bytes(b"x" * 100)
    assert probe.local_probe(str(tmp_path / "small")) is None  # too small: nothing measured
    measured = _fixed_probe(monkeypatch, direct_faster=False)
    (tmp_path / "big").write_bytes(b"x" * 100)  # size does not matter to the stub
    got = probe.local_probe(str(tmp_path / "big"))
    assert got is not None and not got.prefer_direct and len(measured) == 1
    assert probe.local_probe(str(tmp_path / "big")) is got and len(measured) == 1  # kept


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_load_with_a_fixed_read_path_does_not_measure(tmp_path, monkeypatch, direct_io):
    measured = _fixed_probe(monkeypatch, direct_faster=not direct_io)
    w = torch.randn(64, 8)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8))},
        tmp_path / "c",
        sharded_strategy=TorchDistLoadShardedStrategy(direct_io=direct_io),
    )
    assert torch.equal(out["w"], w)
    assert measured == []  # the probe's reads would buy nothing: the path is given
    # a later load that leaves the path to measurement still measures
    dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8))}, tmp_path / "c")
    assert len(measured) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults")
def test_the_probes_destination_is_resident_before_the_clock_starts():
    # np.zeros maps no pages: the first timed region (an O_DIRECT one) paid every page
    # fault of the destination, and lost its only pair per rank in a multi-rank load
    import resource

    out = probe._destination(8 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out[:: buffers.ALIGN] = 2
    faults_taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults_taken < 64  # 2048 pages: all of them were already mapped
