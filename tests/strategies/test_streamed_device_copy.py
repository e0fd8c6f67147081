"""The torch_dist writer's paths: the sync writer copies CUDA tensors into the (pinned)
chunk buffers a chunk at a time and checksums them from the chunks (on CPU the same code
runs by treating CPU tensors as device tensors; it must write the same bytes and digests as
the host path); the async writer hashes a staged image while a helper thread writes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing import integrity
from dist_checkpointing.integrity import BlockSums, blocked_sum
from dist_checkpointing.storage import segments
from dist_checkpointing.strategies.torch_dist import writer
from dist_checkpointing.strategies.torch_dist.plan import WriteEntry, tensor_write_item


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 5 * 4096 + 17),
    cuts=st.lists(st.integers(0, 5 * 4096 + 17), max_size=6),
)
def test_block_sums_fed_in_pieces_equal_the_whole_region_digest(size, cuts):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    bounds = sorted({0, size, *(c for c in cuts if c <= size)})
    sums = BlockSums()
    for a, b in zip(bounds, bounds[1:]):
        sums.update(data[a:b])
    got = sums.item_sum(size + 7, b"head", b"tai")
    want = blocked_sum(size + 7, got.digest, 4, data)
    assert got == want
    h = integrity.new_hasher()
    h.update(b"headtai")
    assert got.digest == h.intdigest()


def _entries() -> list:
    from dist_checkpointing import ShardedTensor

    tensors = {
        "a": torch.randn(25_000),  # spans several chunks and blocks
        "b": torch.randn(3, 3333).to(torch.bfloat16),
        "c": torch.arange(10, dtype=torch.int64),
    }
    return [
        WriteEntry(tensor_write_item(ShardedTensor.from_rank_offsets(k, t)), t)
        for k, t in tensors.items()
    ]


def test_device_path_writes_the_same_bytes_and_digests_as_the_host_path(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "CHUNK", 4 * 4096)  # many chunk switches inside one tensor
    monkeypatch.setattr(integrity, "BLOCK", 3 * 4096)  # blocks straddling chunks
    entries = _entries()
    plan = writer.plan_file("f.distcp", entries)
    sources = [e.data for e in entries]
    (tmp_path / "host").mkdir()
    (tmp_path / "dev").mkdir()
    host = writer.write_streamed(tmp_path / "host", plan, sources, checksums=True)
    monkeypatch.setattr(writer, "_on_device", lambda src: isinstance(src, torch.Tensor))
    copied = []
    real = writer._device_bytes
    monkeypatch.setattr(writer, "_device_bytes", lambda t: copied.append(t) or real(t))
    dev = writer.write_streamed(tmp_path / "dev", plan, sources, checksums=True)
    assert len(copied) == 3  # every tensor went through the chunked device copy
    assert (tmp_path / "dev" / "f.distcp").read_bytes() == (
        tmp_path / "host" / "f.distcp"
    ).read_bytes()
    assert dev == host
    sums = [(tmp_path / d / "f.distcp.sums").read_bytes() for d in ("host", "dev")]
    assert sums[0] == sums[1]
    table = integrity.Checksums.from_json(sums[0], "f").ranges["f.distcp"]
    assert all(s.blocked for _, s in sorted(table.items())[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_save_of_cuda_tensors_streams_through_pinned_chunks_and_loads_exactly(tmp_path):
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.storage import ChunkBuffers
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    src = {
        "w": torch.randn(3000, 1000, device="cuda").to(torch.bfloat16),
        "v": torch.randn(5000, device="cuda"),
        "t": torch.randn(64, 32, device="cuda").t(),  # not contiguous: the host path
    }
    dc.save(
        {k: ShardedTensor.from_rank_offsets(k, t) for k, t in src.items()},
        tmp_path / "c",
        sharded_strategy=TorchDistSaveShardedStrategy(thread_count=2),
    )
    assert any(ChunkBuffers.is_pinned(b) for pair in ChunkBuffers._free for b in pair)
    want = {k: t.cpu() for k, t in src.items()}
    req = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t)) for k, t in want.items()}
    got = dc.load(req, tmp_path / "c")  # checksums verified on load
    assert all(torch.equal(got[k], want[k]) for k in want)


def _staged(tmp_path, monkeypatch):
    """A staged image, and the streamed writer's file and digests of the same tensors."""
    monkeypatch.setattr(segments, "CHUNK", 4 * 4096)  # many requests per image
    entries = _entries()
    plan = writer.plan_file("f.distcp", entries)
    buf = torch.empty(-(-plan.size // 4096) * 4096, dtype=torch.uint8)
    writer.stage_image(plan, [e.data for e in entries], buf)
    (tmp_path / "s").mkdir()
    streamed = writer.write_streamed(tmp_path / "s", plan, [e.data for e in entries], True)
    return plan, buf, streamed


def test_staged_image_is_written_whole_with_the_streamed_paths_digests(tmp_path, monkeypatch):
    plan, buf, streamed = _staged(tmp_path, monkeypatch)
    got = writer.write_image(tmp_path, plan, buf, checksums=True)
    for name in ("f.distcp", "f.distcp.sums"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "s" / name).read_bytes()
    assert got == streamed


def test_a_failed_image_write_raises_after_the_hashing_and_closes_the_file(tmp_path, monkeypatch):
    plan, buf, _ = _staged(tmp_path, monkeypatch)
    calls = []

    def failing_write(self, view, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(self, view, offset)

    real_write = writer.FileWriter.write
    aborted = []
    real_abort = writer.FileWriter.abort
    monkeypatch.setattr(writer.FileWriter, "write", failing_write)
    monkeypatch.setattr(
        writer.FileWriter, "abort", lambda self, *a: aborted.append(1) or real_abort(self, *a)
    )
    with pytest.raises(OSError, match="No space"):
        writer.write_image(tmp_path, plan, buf, checksums=True)
    assert calls == [0, 4 * 4096] and aborted == [1]
