"""Partial reads through a mapping of the page cache: exact bytes, errors instead of SIGBUS,
injected faults, and the same load results where mappings are unavailable."""

from __future__ import annotations

import os

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
