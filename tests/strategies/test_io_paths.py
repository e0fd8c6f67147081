"""The I/O layer at its interface: bytes written and read back exactly on every path, the
buffered fallback where O_DIRECT is refused, damage detected wherever it lies, faults
injected at the storage seam, and the extra memory a resharded load may use."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor, integrity
from dist_checkpointing.errors import CheckpointCorruptedError, CheckpointingException
from dist_checkpointing.storage import (
    FileWriter,
    StreamedFile,
    faults,
    read_region,
    write_segments,
)
from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
from dist_checkpointing.strategies.torch_dist.reader import open_range
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy
from dist_checkpointing.strategies.torch_dist.zipformat import chunk_layout
from tests._sharding import row_block


def _refusing_o_direct() -> faults.Fault:
    """A file system that refuses O_DIRECT: every O_DIRECT request fails with EINVAL."""
    return faults.Fault(
        "*", ops=("read", "write"), error=OSError(errno.EINVAL, "refused"), only_direct=True
    )


def _out(size: int, aligned: bool) -> np.ndarray:
    if aligned:
        return np.frombuffer(mmap.mmap(-1, max(size, 1) + 4096), dtype=np.uint8)[:size]
    return np.zeros(size + 1, dtype=np.uint8)[1:]  # one byte off any alignment


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("offset,size", [(0, 5 * 4096), (4096, 8292), (123, 20_000), (7, 1)])
def test_read_region_returns_exact_bytes_and_reports_progress_in_order(
    tmp_path, aligned, offset, size
):
    data = os.urandom(8 * 4096)
    (tmp_path / "f").write_bytes(data)
    out = _out(size, aligned)
    seen: list = []

    def progress(filled: int) -> None:
        assert out[:filled].tobytes() == data[offset : offset + filled]  # in place when told
        seen.append(filled)

    read_region(str(tmp_path / "f"), offset, out, progress=progress, request=4096)
    assert out.tobytes() == data[offset : offset + size]
    assert seen == sorted(seen) and seen[-1] == size


def test_read_region_past_the_end_of_the_file_is_a_corruption_error(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(3 * 4096 + 100))
    with pytest.raises(CheckpointCorruptedError, match="short read"):
        read_region(str(tmp_path / "f"), 3 * 4096 + 90, np.zeros(20, np.uint8))


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("size", [0, 1, 4096, 3 * 4096 + 17, (64 << 20) + 5])
def test_written_segments_read_back_exactly_with_or_without_o_direct(tmp_path, refused, size):
    data = np.frombuffer(os.urandom(size), dtype=np.uint8) if size else np.zeros(0, np.uint8)
    cut = size // 3
    with faults.injected(*([_refusing_o_direct()] if refused else [])):
        write_segments(tmp_path / "f", [data[:cut], data[cut:]], direct=True, fsync=True)
        out = _out(size, aligned=True)
        read_region(str(tmp_path / "f"), 0, out)
    assert (tmp_path / "f").stat().st_size == size
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("refused", [False, True])
def test_a_streamed_file_takes_chunks_of_any_size_in_order(tmp_path, refused):
    data = np.frombuffer(os.urandom(5 * 4096 + 333), dtype=np.uint8)
    cuts = [0, 100, 4096, 4196, 3 * 4096, 3 * 4096 + 1, data.size]
    with faults.injected(*([_refusing_o_direct()] if refused else [])):
        f = StreamedFile(tmp_path / "f", data.size, fsync=True, direct=True)
        for a, b in zip(cuts, cuts[1:]):
            f.write(data[a:b].copy(), a)  # copies: memory at any address
        with pytest.raises(ValueError, match="expected"):
            f.write(data[:1].copy(), 0)  # out of order
        f.close()
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def test_an_existing_file_is_not_overwritten_by_an_exclusive_writer(tmp_path):
    (tmp_path / "f").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        FileWriter(tmp_path / "f", 10, direct=True, exclusive=True)
    assert (tmp_path / "f").read_bytes() == b"keep"


def test_saves_fall_back_to_buffered_writes_where_o_direct_is_refused(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    w = torch.randn(300, 700)
    with faults.injected(_refusing_o_direct()) as (refusal,):
        dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    assert refusal.calls and "O_DIRECT is not usable" in caplog.text
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}, tmp_path / "c")
    assert torch.equal(got["w"], w)


@pytest.mark.parametrize("direct_io", [True, False])
def test_either_write_path_saves_what_loads_bit_exactly(tmp_path, direct_io):
    sd = {f"t{i}": torch.randn(257 + i, 1031) for i in range(3)}
    sd["b"] = torch.randint(0, 255, (4099,), dtype=torch.uint8)
    dc.save(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in sd.items()},
        tmp_path / "c",
        sharded_strategy=TorchDistSaveShardedStrategy(direct_io=direct_io),
    )
    got = dc.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in sd.items()},
        tmp_path / "c",
    )
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_an_injected_read_error_fails_the_load_naming_the_file(tmp_path):
    w = torch.randn(64, 64)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    with faults.injected(faults.Fault("*.distcp", ops=("read",), error=OSError(errno.EIO, "EIO"))):
        with pytest.raises(CheckpointingException, match=r"\.distcp"):
            dc.load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}, tmp_path / "c"
            )


def _save_blocked(tmp_path, monkeypatch, w: torch.Tensor) -> None:
    # small checksum blocks: many blocks per item, so block-by-block checks are exercised
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


def _load(ckpt, w: torch.Tensor, request: list) -> dict:
    if request == ["cols"]:
        sd = {
            "p0": ShardedTensor(
                "w",
                torch.zeros(w.shape[0], 300),
                w.dtype,
                (w.shape[0], 300),
                w.shape,
                (0, 200),
                None,
            )
        }
    else:
        sd = {f"p{i}": row_block("w", w, r0, r1) for i, (r0, r1) in enumerate(request)}
    return dc.load(sd, ckpt, validate_access_integrity=False)


# every way a chunk's data is read
PATHS = {
    "whole chunk": [(0, 200)],
    "rows in place (resharded)": [(40, 90)],
    "rows from the first row": [(0, 90)],
    "rows to the last row": [(40, 200)],
    "two parts of a chunk (scattered)": [(40, 60), (60, 90)],
    "a column block (scattered)": ["cols"],
}


@pytest.mark.parametrize("path_name", list(PATHS))
def test_every_read_path_loads_exact_bytes_and_finds_a_damaged_block(
    tmp_path, monkeypatch, path_name
):
    request = PATHS[path_name]
    w = torch.randn(200, 1000)  # 4000-byte rows: blocks and rows never line up
    _save_blocked(tmp_path, monkeypatch, w)
    ckpt = tmp_path / "c"
    got = _load(ckpt, w, request)
    if request == ["cols"]:
        assert torch.equal(got["p0"], w[:, 200:500])
    else:
        for i, (r0, r1) in enumerate(request):
            assert torch.equal(got[f"p{i}"], w[r0:r1])
    path, data0 = _data_offset(ckpt)
    bad = 55 * 4000 + 17  # a byte of row 55, in block 53 of the data
    _flip(path, data0 + bad)
    lo = data0 + bad // 4096 * 4096
    with pytest.raises(CheckpointCorruptedError, match=f"bytes {lo}-{lo + 4096} of"):
        _load(ckpt, w, request)


@pytest.mark.parametrize("bad", [159_800, 360_100], ids=["before the rows", "after the rows"])
def test_rows_read_in_place_find_damage_in_their_edge_blocks_outside_the_rows(
    tmp_path, monkeypatch, bad
):
    # rows 40-90 are data bytes 160000-360000; their first and last blocks extend past them
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    path, data0 = _data_offset(tmp_path / "c")
    assert torch.equal(_load(tmp_path / "c", w, [(40, 90)])["p0"], w[40:90])
    _flip(path, data0 + bad)
    lo = data0 + bad // 4096 * 4096
    with pytest.raises(CheckpointCorruptedError, match=f"bytes {lo}-{lo + 4096} of"):
        _load(tmp_path / "c", w, [(40, 90)])


def test_damage_outside_the_requested_rows_is_not_read(tmp_path, monkeypatch):
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    path, data0 = _data_offset(tmp_path / "c")
    _flip(path, data0 + 190 * 4000)
    assert torch.equal(_load(tmp_path / "c", w, [(0, 50)])["p0"], w[:50])


@pytest.mark.parametrize("where", ["pickle", "directory"])
@pytest.mark.parametrize("rows", [(0, 200), (40, 90)])
def test_damaged_zip_records_are_found(tmp_path, monkeypatch, where, rows):
    w = torch.randn(200, 1000)
    _save_blocked(tmp_path, monkeypatch, w)
    ckpt = tmp_path / "c"
    (info,) = [i for k, i in read_metadata(ckpt).storage_data.items() if k.fqn == "w"]
    path, data0 = _data_offset(ckpt)
    if where == "pickle":  # the stored shape's first digit: 200 -> a different shape
        _flip(path, open(path, "rb").read().index(b"K\xc8", info.offset, data0) + 1)
    else:
        _flip(path, info.offset + info.length - 30)
    with pytest.raises(CheckpointCorruptedError, match="w"):
        _load(ckpt, w, [rows])


_MEMORY_CHILD = textwrap.dedent(
    """
    import sys, torch
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    # the backend's modules (and DCP's, which they import) before the baseline
    import dist_checkpointing.strategies.torch_dist.load

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
    before = hwm()
    got = dc.load(req, ckpt, validate_access_integrity=False)
    assert all(bool((got[f"t{i}"][:, 0] == i).all()) for i in range(n))
    print(hwm() - before)
    """
)


@pytest.mark.timeout(300)
def test_resharded_load_larger_than_the_memory_bound_stays_within_it(tmp_path):
    # 12 stored chunks of 16 MiB (192 MiB read, half of each chunk needed): the bound is the
    # rank's tensors (allocated before measuring) plus, per reading thread, the needed rows
    # of one stored chunk (here all rows) and two checksum blocks.
    n, rows, cols = 12, 4096, 1024
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((rows, cols), float(i)))
        for i in range(n)
    }
    dc.save(sd, tmp_path / "c")
    del sd
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(tmp_path / "c"), str(n), str(rows), str(cols)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=240,
        check=True,
    )
    extra = int(out.stdout.split()[-1])
    chunk = rows * cols * 4
    bound = 2 * (chunk + 2 * integrity.BLOCK)
    assert n * chunk > 3 * bound  # the load is well larger than the bound
    assert extra <= bound + (16 << 20), f"{extra >> 20} MiB beyond the tensors"
