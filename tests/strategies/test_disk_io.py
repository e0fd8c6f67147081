"""The torch_dist writer and reader: zip items of our own, O_DIRECT with fallback, byte ranges."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.integrity import BLOCK
from dist_checkpointing.storage import faults
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
from dist_checkpointing.strategies.torch_dist.reader import open_range
from dist_checkpointing.strategies.torch_dist.zipformat import chunk_layout, zip_item_layout

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    offset=st.integers(0, 3 * 4096),
)
def test_generated_items_load_with_torch_load(dtype, shape, offset):
    t = (torch.randn(shape) * 50).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    layout = zip_item_layout(dtype, shape, offset)
    assert layout is not None and (offset + len(layout.head)) % 4096 == 0
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    back = torch.load(io.BytesIO(layout.head + data + layout.tail), weights_only=True)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_data_of_large_tensors_lands_on_4096_byte_offsets(tmp_path):
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(1024, 256 + i))
        for i in range(5)
    }
    dc.save(sd, tmp_path / "c")
    md = read_metadata(tmp_path / "c")
    for index, info in md.storage_data.items():
        with open_range(tmp_path / "c" / info.relative_path, info) as stream:
            layout = chunk_layout(stream.raw)
        assert layout is not None and (info.offset + layout.data_offset) % 4096 == 0, index.fqn


def _big(rows: int = 4096, cols: int = 1024) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)  # 16 MiB: 4 blocks


def test_row_slice_reads_only_the_blocks_it_needs(tmp_path, monkeypatch):
    w = _big()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    rows = slice(1500, 1700)  # 800 KiB, inside the second 4 MiB block
    req = ShardedTensor(
        "w", torch.zeros(200, 1024), torch.float32, (200, 1024), (4096, 1024), (1500, 0), None
    )
    with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
        got = dc.load({"w": req}, tmp_path / "c", validate_access_integrity=False)
    assert torch.equal(got["w"], w[rows])
    # the rows straight into the destination (the rest of their 4 MiB block is read from
    # the item's stream to verify it), not the 16 MiB chunk
    assert [c.nbytes for c in spy.calls] == [200 * 1024 * 4]


def test_damage_outside_the_rows_read_is_not_needed_inside_is_caught(tmp_path):
    w = _big()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    data = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp" and p.stat().st_size)
    raw = bytearray(data.read_bytes())
    start = raw.index(w[0].numpy().tobytes()[:64])  # the data region
    raw[start + 3 * BLOCK + 10] ^= 0xFF  # in the fourth block
    data.write_bytes(bytes(raw))

    def request(r0: int) -> dict:
        return {
            "w": ShardedTensor(
                "w", torch.zeros(100, 1024), torch.float32, (100, 1024), (4096, 1024), (r0, 0), None
            )
        }

    got = dc.load(request(0), tmp_path / "c", validate_access_integrity=False)  # first block only
    assert torch.equal(got["w"], w[:100])
    with pytest.raises(
        CheckpointCorruptedError, match=r"checksum mismatch in data block 3, bytes \d+-\d+ of"
    ):
        dc.load(request(3500), tmp_path / "c", validate_access_integrity=False)


def test_load_strategy_refuses_a_thread_count_below_one():
    from dist_checkpointing.errors import CheckpointingException

    with pytest.raises(CheckpointingException, match="thread_count"):
        TorchDistLoadShardedStrategy(thread_count=0)
