"""Host staging buffers of async save: layout, reuse, bounded memory, GPU sources."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing.strategies._staging import ALIGN, HostBufferPool


def _tensors():
    return [
        torch.arange(10, dtype=torch.float32),
        torch.ones(3, 5, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.empty(0, 4, dtype=torch.int64),
        torch.tensor(7, dtype=torch.int8),
    ]


def test_stage_copies_every_dtype_into_aligned_slots_owning_their_bytes():
    pool = HostBufferPool()
    src = _tensors()
    buf = pool.stage(src)
    assert buf.flat.is_shared()
    for view, slot, t in zip(buf.views(), buf.slots, src):
        assert slot.offset % ALIGN == 0
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        assert (
            view.untyped_storage().nbytes() == t.numel() * t.element_size()
        )  # torch.save writes just these
    src[0].fill_(-1)  # the staged copy is a snapshot
    assert buf.views()[0][3].item() == 3.0


def test_buffers_are_reused_per_structure_and_bounded():
    pool = HostBufferPool(max_free_per_key=1, max_keys=1)
    first = pool.stage(_tensors())
    allocated = pool.allocated_bytes
    pool.release(first)
    again = pool.stage(_tensors())
    assert again is first and pool.allocated_bytes == allocated
    other = pool.stage([torch.zeros(100)])  # a second structure while the first is in use
    pool.release(again)
    pool.release(other)  # only one structure is kept: the least recently used goes
    assert pool.allocated_bytes == other.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sources_are_copied_through_pinned_buffers():
    pool = HostBufferPool()
    src = [torch.randn(1024, 1024, device="cuda"), torch.arange(5, device="cuda")]
    buf = pool.stage(src)
    assert buf.pinned
    for view, t in zip(buf.views(), src):
        assert torch.equal(view, t.cpu())
    pool.release(buf)
    assert pool.stage(src) is buf
