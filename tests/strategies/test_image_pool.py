"""The async save's staging pool: reuse, bounds, and pinning (simulated on CPU, real on GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_checkpointing.storage import buffers
from dist_checkpointing.storage.buffers import ALIGN, ImagePool
from tests._devices import CPU_AND_CUDA


def _plan(sig: str, size: int = 10_000) -> SimpleNamespace:
    return SimpleNamespace(signature=(sig,), size=size)


def test_buffers_are_reused_per_signature_aligned_and_bounded():
    pool = ImagePool(max_free=1, max_signatures=2)
    a = _plan("a")
    first = pool.acquire(a, pin=False)
    assert first.numel() % ALIGN == 0 and first.numel() >= a.size
    assert first.data_ptr() % ALIGN == 0
    allocated = pool.allocated_bytes
    pool.release(a, first)
    assert pool.acquire(a, pin=False) is first and pool.allocated_bytes == allocated
    second = pool.acquire(a, pin=False)  # the first is in use: a new one
    assert second is not first and pool.allocated_bytes == 2 * allocated
    pool.release(a, first)
    pool.release(a, second)  # beyond max_free: freed
    assert pool.allocated_bytes == allocated
    for sig in ("b", "c"):  # two newer signatures push "a" out
        pool.release(_plan(sig), pool.acquire(_plan(sig), pin=False))
    assert pool.allocated_bytes == 2 * allocated
    assert pool.acquire(a, pin=False) is not first


def test_pinning_is_done_once_and_undone_when_a_buffer_is_dropped(monkeypatch):
    pinned, unpinned = [], []
    monkeypatch.setattr(buffers, "pin", lambda b: pinned.append(b.data_ptr()) or True)
    monkeypatch.setattr(buffers, "unpin", lambda b: unpinned.append(b.data_ptr()))
    pool = ImagePool(max_free=1, max_signatures=1)
    a = _plan("a")
    cpu = pool.acquire(a, pin=False)
    assert not pool.is_pinned(cpu) and pinned == []
    pool.release(a, cpu)
    buf = pool.acquire(a, pin=True)  # a CPU save's buffer reused by a GPU save: pinned now
    assert buf is cpu and pool.is_pinned(buf) and pinned == [buf.data_ptr()]
    pool.release(a, buf)
    assert pool.acquire(a, pin=True) is buf and pinned == [buf.data_ptr()]  # not pinned twice
    extra = pool.acquire(a, pin=True)
    pool.release(a, buf)
    pool.release(a, extra)  # beyond max_free: unpinned before it is freed
    assert unpinned == [extra.data_ptr()]
    pool.release(_plan("b"), pool.acquire(_plan("b"), pin=False))  # "a" is pushed out
    assert sorted(unpinned) == sorted([extra.data_ptr(), buf.data_ptr()])


def test_pin_is_a_no_op_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert buffers.pin(torch.empty(ALIGN, dtype=torch.uint8)) is False


@pytest.mark.parametrize(
    "device",
    CPU_AND_CUDA,
)
def test_async_save_stages_before_returning_pinned_for_cuda_sources(tmp_path, monkeypatch, device):
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    src = torch.randn(1024, 1024, device=device)
    expected = src.cpu().clone()
    strategy = TorchDistSaveShardedStrategy()
    staged = []
    real_acquire = strategy._images.acquire_group

    def spy(plans, pin):
        bufs = real_acquire(plans, pin)
        staged.extend(bufs)
        return bufs

    monkeypatch.setattr(strategy._images, "acquire_group", spy)
    req = dc.save(
        {"w": ShardedTensor.from_rank_offsets("w", src)},
        tmp_path / "c",
        sharded_strategy=strategy,
        async_sharded_save=True,
    )
    src.zero_()  # allowed as soon as save returns: the copy is complete
    assert staged and all(strategy._images.is_pinned(b) == (device == "cuda") for b in staged)
    req.execute_sync()
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1024, 1024))}
    assert torch.equal(dc.load(req, tmp_path / "c")["w"], expected)


def test_a_group_of_equal_layouts_is_reused_whole():
    pool = ImagePool(max_free=1, max_signatures=2)
    plans = [_plan("a") for _ in range(4)]  # four files with one layout, as one save writes them
    first = pool.acquire_group(plans, pin=False)
    assert len({b.data_ptr() for b in first}) == 4 and pool.allocations == 4
    pool.release_group(plans, first)
    again = pool.acquire_group(plans, pin=False)
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in first]
    assert pool.allocations == 4
    other = pool.acquire_group(plans, pin=False)  # the set is in use: a new set
    assert pool.allocations == 8
    pool.release_group(plans, again)
    pool.release_group(plans, other)  # beyond max_free sets: freed
    assert pool.allocated_bytes == 4 * again[0].numel()


def _equal_tensors(device: str, step: int) -> dict:
    from dist_checkpointing import ShardedTensor

    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"t{i}", torch.full((256, 1024), float(step * 10 + i), device=device)
        )
        for i in range(4)
    }


@pytest.mark.parametrize("thread_count", [4, 2])
@pytest.mark.parametrize(
    "device",
    CPU_AND_CUDA,
)
def test_consecutive_async_saves_reuse_every_staging_buffer(
    tmp_path, monkeypatch, device, thread_count
):
    """Several files of one layout per save: the second and third
    saves allocate (and pin) nothing; each checkpoint loads back exactly."""
    import dist_checkpointing as dc
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(thread_count=thread_count)
    strategy._images = pool = ImagePool()  # counters of this test's saves only
    counts = []
    for step in range(3):
        req = dc.save(
            _equal_tensors(device, step),
            tmp_path / f"c{step}",
            sharded_strategy=strategy,
            async_sharded_save=True,
        )
        req.execute_sync()
        counts.append((pool.allocations, pool.pins, pool.allocated_bytes))
    assert len(list((tmp_path / "c0").glob("*.distcp"))) == thread_count
    assert counts[0][0] == thread_count, counts
    assert counts[1] == counts[0] and counts[2] == counts[0], counts
    if device == "cuda":
        assert counts[0][1] == thread_count
    for step in range(3):
        want = {k: v.data.cpu() for k, v in _equal_tensors("cpu", step).items()}
        req = {k: dc.ShardedTensor.from_rank_offsets(k, torch.empty(256, 1024)) for k in want}
        got = dc.load(req, tmp_path / f"c{step}")
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_strategies_made_per_save_share_the_staging_buffers(tmp_path):
    """megatron's training loop builds a save strategy per save: the second strategy's
    async save reuses the first one's staging images instead of allocating (and pinning)."""
    import dist_checkpointing as dc
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    first, second = TorchDistSaveShardedStrategy(), TorchDistSaveShardedStrategy()
    assert first._images is second._images
    pool = first._images
    for step, strategy in enumerate([first, second]):
        before = pool.allocations
        req = dc.save(
            _equal_tensors("cpu", step),
            tmp_path / f"c{step}",
            sharded_strategy=strategy,
            async_sharded_save=True,
        )
        req.execute_sync()
        if step == 1:
            assert pool.allocations == before, "the second strategy allocated new images"


def test_a_pool_that_goes_away_unpins_its_buffers(monkeypatch):
    """Memory must never be unmapped while registered with the driver (the next
    registration of that range fails, and its error surfaces in the next CUDA call)."""
    import gc

    pinned, unpinned = set(), []
    monkeypatch.setattr(buffers, "pin", lambda b: pinned.add(b.data_ptr()) or True)
    monkeypatch.setattr(buffers, "unpin", lambda b: unpinned.append(b.data_ptr()))

    class _Plan:
        size = 8192
        signature = ("p",)

    pool = ImagePool()
    kept = pool.acquire(_Plan(), pin=True)
    pool.release(_Plan(), kept)
    held = pool.acquire(_Plan(), pin=True)  # the same buffer, still in use
    in_use = pool.acquire(_Plan(), pin=True)  # a second one
    assert len(pinned) == 2 and not unpinned
    del pool, kept, held
    gc.collect()
    assert sorted(unpinned) == sorted(pinned)
    del in_use
