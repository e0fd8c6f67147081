"""Partial reads through a mapping of the page cache: exact bytes, errors instead of SIGBUS,
injected faults, and the same load results where mappings are unavailable."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.storage import faults, mapped
from dist_checkpointing.strategies.torch_dist import reader

pytestmark = pytest.mark.skipif(not mapped.available(), reason="no MADV_POPULATE_READ here")


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "f.bin"
    data.tofile(path)
    return str(path), data


@pytest.mark.parametrize("offset,nbytes", [(0, 3 << 20), (12345, 1 << 20), (65536, 1), (7, 0)])
def test_a_mapped_region_holds_the_file_bytes_and_reports_each_step(data_file, offset, nbytes):
    path, data = data_file
    seen = []
    with mapped.mapped_region(path, offset, nbytes) as m:
        m.populate(seen.append, 300_000)
        assert np.array_equal(m.array, data[offset : offset + nbytes])
    assert seen == sorted(seen) and (not nbytes or seen[-1] == nbytes)
    assert len(seen) == -(-nbytes // 300_000)


def test_a_region_past_the_end_of_the_file_is_refused_before_mapping(data_file):
    path, data = data_file
    with pytest.raises(CheckpointCorruptedError, match="f.bin"):
        with mapped.mapped_region(path, len(data) - 10, 11):
            pass


def test_a_file_truncated_after_mapping_raises_instead_of_killing_the_process(data_file):
    path, data = data_file
    with mapped.mapped_region(path, 4096, 2 << 20) as m:
        os.truncate(path, 1 << 20)
        with pytest.raises(CheckpointCorruptedError, match="short read"):
            m.populate(None, 1 << 18)


def test_an_injected_read_error_on_a_mapped_step_propagates(data_file):
    path, _ = data_file
    with faults.injected(faults.Fault("*.bin", ops=("read",), error=OSError(5, "EIO"))):
        with mapped.mapped_region(path, 0, 1 << 20) as m:
            with pytest.raises(OSError, match="EIO"):
                m.populate(None, 1 << 18)


def _column_load(ckpt, w: torch.Tensor) -> torch.Tensor:
    req = {
        "w": ShardedTensor(
            "w", torch.zeros(w.shape[0], 3), w.dtype, (w.shape[0], 3), tuple(w.shape), (0, 5), None
        )
    }
    return dc.load(req, ckpt, validate_access_integrity=False)["w"]


@pytest.mark.parametrize("mapping", [True, False])
def test_column_slices_load_exactly_mapped_or_copied(tmp_path, monkeypatch, mapping):
    monkeypatch.setattr(mapped, "_supported", mapping)
    monkeypatch.setattr(reader, "MAP_MIN", 1)
    w = torch.randn(300, 11)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    maps = []
    real = mapped.mapped_region
    monkeypatch.setattr(
        mapped,
        "mapped_region",
        lambda *a: maps.append(a) or real(*a),  # type: ignore[func-returns-value]
    )
    assert torch.equal(_column_load(tmp_path / "c", w), w[:, 5:8])
    assert bool(maps) == mapping


def test_a_failed_mapped_read_fails_the_load_naming_the_file(tmp_path, monkeypatch):
    w = torch.randn(300, 11)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    monkeypatch.setattr(reader, "READ_REQUEST", 4096)
    monkeypatch.setattr(reader, "MAP_MIN", 1)
    with faults.injected(faults.Fault("*.distcp", ops=("read",), error=OSError(5, "EIO"))):
        with pytest.raises(Exception, match="EIO"):
            _column_load(tmp_path / "c", w)


def test_small_partial_reads_are_copied_not_mapped(tmp_path, monkeypatch):
    w = torch.randn(300, 11)  # 13 KiB: below MAP_MIN
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    monkeypatch.setattr(
        mapped, "mapped_region", lambda *a: pytest.fail("a small region was mapped")
    )
    assert torch.equal(_column_load(tmp_path / "c", w), w[:, 5:8])


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("through_libc", [True, False])
def test_populating_ahead_reports_every_step_in_order_within_its_lead(
    data_file, monkeypatch, ahead, through_libc
):
    if not through_libc:  # the C library's madvise missing: mmap's own is used
        monkeypatch.setattr(mapped, "libc_function", lambda *a: None)
    path, data = data_file
    offset, nbytes, request = 12345, (3 << 20) - 12345, 200_000
    populated = []  # the region's bytes populated after each madvise call
    real = mapped.MappedRegion._advise

    def advise(self, start, length):
        populated.append(start + length - self._skip)
        real(self, start, length)

    monkeypatch.setattr(mapped.MappedRegion, "_advise", advise)
    seen = []
    with mapped.mapped_region(path, offset, nbytes) as m:

        def progress(n):
            told = seen[-1] if seen else 0
            assert max(populated) >= n  # never told of bytes not yet populated
            assert max(populated) - told < (ahead + 1) * request  # the helper's lead is bounded
            assert np.array_equal(m.array[told:n], data[offset + told : offset + n])
            seen.append(n)

        m.populate(progress, request, ahead)
    assert seen == [min(nbytes, (k + 1) * request) for k in range(-(-nbytes // request))]
    assert not [t for t in threading.enumerate() if t.name == "dc-populate"]


def test_an_error_raised_by_progress_stops_the_helper_and_propagates(data_file):
    path, _ = data_file
    calls = []

    def progress(n):
        calls.append(n)
        if len(calls) == 2:
            raise CheckpointCorruptedError("damaged block")

    with mapped.mapped_region(path, 0, 3 << 20) as m:
        with pytest.raises(CheckpointCorruptedError, match="damaged block"):
            m.populate(progress, 1 << 18, 4)
    assert len(calls) == 2
    assert not [t for t in threading.enumerate() if t.name == "dc-populate"]


@pytest.mark.parametrize("failing_step", [0, 3])
def test_a_read_error_in_the_helper_reaches_the_caller_after_the_steps_before_it(
    data_file, monkeypatch, failing_step
):
    path, _ = data_file
    request = 1 << 18

    def check(op, p, offset, nbytes, direct):  # the disk fails from the given step on
        if offset >= failing_step * request:
            raise OSError(5, "EIO")

    monkeypatch.setattr(mapped.faults, "check", check)
    seen = []
    with mapped.mapped_region(path, 0, 3 << 20) as m:
        with pytest.raises(OSError, match="EIO"):
            m.populate(seen.append, request, 2)
    assert seen == [(k + 1) * request for k in range(failing_step)]
    assert not [t for t in threading.enumerate() if t.name == "dc-populate"]


def test_only_groups_that_leave_out_part_of_each_row_count_as_strided():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    def item(offsets, lengths):
        idx = MetadataIndex("w", torch.Size([0, 0]))
        return ReadItem(LoadItemType.TENSOR, idx, torch.Size([0, 0]), idx, offsets, lengths)

    stored = ((8, 4), torch.float32)

    def group(*reads):
        return reader.ChunkGroup(None, list(reads), stored)  # type: ignore[arg-type]

    assert not reader.strided(group(item((0, 0), (8, 4))))  # the whole chunk
    assert not reader.strided(group(item((2, 0), (3, 4))))  # whole rows
    assert reader.strided(group(item((0, 1), (8, 2))))  # a column block
    assert reader.strided(group(item((0, 0), (2, 4)), item((4, 0), (2, 4))))  # two regions
    assert not reader.strided(reader.ChunkGroup(None, [item((0, 1), (8, 2))], None))
