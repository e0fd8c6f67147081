"""O_DIRECT loads of whole chunks and row ranges as one stream per data file (`stream`)."""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor, integrity
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.storage import direct, inflight
from dist_checkpointing.strategies.torch_dist import reader, stream
from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
from tests._sharding import row_block
from tests.strategies.test_load_paths import _flip

DIRECT = TorchDistLoadShardedStrategy(direct_io=True)

#: tensors of one file: sizes that put items and data regions at unaligned offsets, one
#: smaller than a page, rows that never line up with 4 KiB blocks
SHAPES = {"a": (200, 1000), "b": (3, 7), "c": (1000, 333), "d": (64, 1024), "e": (1, 5)}


def _save(tmp_path, monkeypatch) -> dict:
    monkeypatch.setattr(integrity, "BLOCK", 4096)  # many blocks per item
    monkeypatch.setattr(reader, "READ_REQUEST", 3 * 4096)  # requests straddle item ends
    monkeypatch.setattr(reader, "STREAM_REQUEST", 3 * 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    dc.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, tmp_path / "c")
    return tensors


def _whole(tensors: dict) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in tensors.items()}


def _rows(tensors: dict, frac=(0.3, 0.8)) -> dict:
    out = {}
    for k, t in tensors.items():
        r0 = int(t.shape[0] * frac[0])
        r1 = max(r0 + 1, int(t.shape[0] * frac[1]))
        out[k] = row_block(k, t, r0, r1)
    return out


def _expected(tensors: dict, request: dict) -> dict:
    return {
        k: tensors[k][sh.global_offset[0] : sh.global_offset[0] + sh.local_shape[0]]
        for k, sh in request.items()
    }


def _spy_streams(monkeypatch) -> list:
    """Records `(items given, items finished)` of every stream."""
    got: list = []
    real = stream.read_stream

    def spy(path, items, request, progress=None, depth=stream.direct.DEPTH):
        out = real(path, items, request, progress, depth)
        got.append((len(items), out[1]))
        return out

    monkeypatch.setattr(stream, "read_stream", spy)
    return got


def _item(ckpt, key: str):
    md = read_metadata(ckpt)
    (info,) = [i for k, i in md.storage_data.items() if k.fqn == key]
    return ckpt / info.relative_path, info


@pytest.mark.parametrize("kind", ["whole", "rows"])
def test_a_files_chunks_load_exactly_as_one_stream(tmp_path, monkeypatch, kind):
    tensors = _save(tmp_path, monkeypatch)
    streams = _spy_streams(monkeypatch)
    request = _whole(tensors) if kind == "whole" else _rows(tensors)
    expected = _expected(tensors, request)
    got = dc.load(request, tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False)
    for k in tensors:
        assert torch.equal(got[k], expected[k]), k
    assert streams == [(len(SHAPES), len(SHAPES))]  # one stream took every chunk


@pytest.mark.parametrize("kind", ["whole", "rows"])
def test_a_damaged_block_in_the_middle_of_a_stream_names_its_bytes(tmp_path, monkeypatch, kind):
    tensors = _save(tmp_path, monkeypatch)
    path, info = _item(tmp_path / "c", "c")
    expected = integrity.read_checksums(tmp_path / "c").expected_range(
        str(info.relative_path), info.offset, info.length, "c"
    )
    bad = 600 * 333 * 4 + 5  # row 600 of "c": in every request of both kinds
    _flip(path, info.offset + expected.data_off + bad)
    lo = info.offset + expected.data_off + bad // 4096 * 4096
    request = _whole(tensors) if kind == "whole" else _rows(tensors)
    with pytest.raises(CheckpointCorruptedError, match=f"bytes {lo}-{lo + 4096} of"):
        dc.load(request, tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False)


@pytest.mark.parametrize("where", ["pickle", "directory"])
@pytest.mark.parametrize("kind", ["whole", "rows"])
def test_damaged_zip_records_are_found_in_a_stream(tmp_path, monkeypatch, where, kind):
    tensors = _save(tmp_path, monkeypatch)
    path, info = _item(tmp_path / "c", "a")
    data = open(path, "rb").read()
    if where == "pickle":  # the stored shape's first digit: 200 -> another shape
        _flip(path, data.index(b"K\xc8", info.offset, info.offset + 4096) + 1)
    else:
        _flip(path, info.offset + info.length - 30)
    request = _whole(tensors) if kind == "whole" else _rows(tensors)
    with pytest.raises(CheckpointCorruptedError, match="'a'"):
        dc.load(request, tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False)


def test_a_chunk_not_in_the_plain_layout_and_those_after_it_are_read_the_ordinary_way(
    tmp_path, monkeypatch
):
    tensors = _save(tmp_path, monkeypatch)
    streams = _spy_streams(monkeypatch)
    real = stream.head_layout
    calls = []

    def third_not_plain(head, data_off, data_len):
        calls.append(1)
        return None if len(calls) == 3 else real(head, data_off, data_len)

    monkeypatch.setattr(stream, "head_layout", third_not_plain)
    got = dc.load(
        _whole(tensors), tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False
    )
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
    assert streams == [(len(SHAPES), 2)]


def test_o_direct_refused_part_way_through_a_stream_reads_the_rest_buffered(
    tmp_path, monkeypatch, caplog
):
    tensors = _save(tmp_path, monkeypatch)
    streams = _spy_streams(monkeypatch)
    real = inflight.read_upto
    calls = []

    def refuse_fourth(fd, offset, view):
        calls.append(offset)
        if len(calls) == 4:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, offset, view)

    monkeypatch.setattr(inflight, "read_upto", refuse_fourth)
    caplog.set_level(logging.INFO)
    got = dc.load(
        _whole(tensors), tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False
    )
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
    assert len(streams) == 1 and streams[0][1] < len(SHAPES)
    assert "O_DIRECT reads are not usable" in caplog.text


def test_a_truncated_file_is_reported_not_streamed(tmp_path, monkeypatch):
    tensors = _save(tmp_path, monkeypatch)
    path, info = _item(tmp_path / "c", "e")
    os.truncate(path, info.offset + info.length - 1)
    with pytest.raises(CheckpointCorruptedError, match="truncated"):
        dc.load(
            _whole(tensors),
            tmp_path / "c",
            sharded_strategy=DIRECT,
            validate_access_integrity=False,
        )


def test_other_dtypes_and_strided_requests_leave_the_stream_and_still_load(tmp_path, monkeypatch):
    tensors = _save(tmp_path, monkeypatch)
    streams = _spy_streams(monkeypatch)
    request = _whole(tensors)
    request["a"] = ShardedTensor.from_rank_offsets("a", torch.zeros(200, 1000, dtype=torch.float64))
    c = tensors["c"]
    request["c"] = ShardedTensor(  # a column block: a strided part of every row
        "c", torch.zeros(1000, 100), c.dtype, (1000, 100), tuple(c.shape), (0, 50), None
    )
    got = dc.load(request, tmp_path / "c", sharded_strategy=DIRECT, validate_access_integrity=False)
    assert torch.equal(got["a"], tensors["a"].double())
    assert torch.equal(got["c"], c[:, 50:150])
    for k in ("b", "d", "e"):
        assert torch.equal(got[k], tensors[k]), k
    assert streams == [(3, 3)]


def test_requests_stay_in_flight_across_the_ends_of_regions(tmp_path):
    """The first request of a region is under way while the last one of the region before
    it is delivered (a pipeline per region would leave the disk idle there)."""
    data = np.random.default_rng(0).integers(0, 255, 64 * 4096, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    spans = [(0, 4 * 4096), (8 * 4096, 4 * 4096), (20 * 4096, 2 * 4096)]
    slots = [memoryview(bytearray(2 * 4096)) for _ in range(3)]
    started: list = []
    seen = threading.Condition()
    real = inflight.read_upto

    def recording(fd, offset, view):
        with seen:
            started.append(offset)
            seen.notify_all()
        return real(fd, offset, view)

    got: list = []
    ahead: list = []

    def deliver(at, view):
        got.append((at, bytes(view)))
        if at == 2 * 4096:  # the first region's last request
            with seen:
                ahead.append(seen.wait_for(lambda: 8 * 4096 in started, timeout=5))

    fd = os.open(path, os.O_RDONLY)
    try:
        inflight_read = inflight.read_spans_through_slots
        orig, inflight.read_upto = inflight.read_upto, recording
        try:
            assert inflight_read(fd, spans, slots, deliver)
        finally:
            inflight.read_upto = orig
    finally:
        os.close(fd)
    assert ahead == [True]
    want = [
        (o, data[o : o + 2 * 4096].tobytes()) for s, n in spans for o in range(s, s + n, 2 * 4096)
    ]
    assert got == want


def test_a_stream_that_meets_the_end_of_the_file_stops_there(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (5 * 4096 + 100))
    slots = [memoryview(bytearray(4096)) for _ in range(2)]
    got: list = []
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = inflight.read_spans_through_slots(
            fd, [(0, 2 * 4096), (4 * 4096, 4 * 4096)], slots, lambda at, v: got.append((at, len(v)))
        )
    finally:
        os.close(fd)
    assert not whole
    assert got == [(0, 4096), (4096, 4096), (4 * 4096, 4096), (5 * 4096, 100)]


def test_aligned_spans_widen_and_merge():
    A = direct.ALIGN
    spans = [(10, 5), (A + 1, 2), (5 * A - 1, 2), (7 * A, 0)]
    assert direct._aligned_spans(spans) == [(0, 2 * A), (4 * A, 2 * A)]
    assert direct._aligned_spans([(3 * A, A), (0, A), (A, 1)]) == [(0, 2 * A), (3 * A, A)]
    assert direct._aligned_spans([]) == []
