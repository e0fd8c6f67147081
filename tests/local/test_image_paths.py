"""Local images through every write path give the same file and load back bit-exactly:
staged (pooled buffer) or unstaged (written from the tensors themselves), durable (fsync)
or not, on CPU and (with the `gpu` mark) from CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing.local._image import (
    decode_image,
    finish_image,
    read_image,
    release_image,
    start_image,
    write_image,
)
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from tests._devices import CPU_AND_CUDA


def _state(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * (1 << 20) // 4 + 5, generator=g)  # 3 MiB, not a multiple of 4096
    return {
        "big": big.to(device),
        "odd": torch.randn(7, 13, generator=g).to(torch.bfloat16).to(device),
        "strided": torch.randn(40, 30, generator=g).t().to(device),  # not contiguous
        "empty": torch.empty(0, 4, device=device),
        "ints": torch.arange(1001, dtype=torch.int64).to(device),
        "flag": torch.tensor([True, False, True], device=device),
        "meta": {"step": 5, "names": ["a", "b"]},
    }


def _equal(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k].cpu(), b[k].cpu()) and a[k].dtype == b[k].dtype
        for k in a
        if isinstance(a[k], torch.Tensor)
    )


@pytest.mark.parametrize("small_chunks", [False, True])
@pytest.mark.parametrize("fsync", [True, False])
def test_staged_and_unstaged_images_write_the_same_bytes(
    tmp_path, monkeypatch, fsync, small_chunks
):
    if small_chunks:  # many chunk boundaries, inside and across segments
        from dist_checkpointing.storage import segments

        monkeypatch.setattr(segments, "CHUNK", 3 * 4096)
    files = []
    # staged; unstaged finished first (as before replication); unstaged finished while
    # written (each tensor hashed as it is written)
    for name, stage, finish_first in (("s", True, True), ("u", False, True), ("w", False, False)):
        image = start_image(BasicTensorAwareStateDict(_state()), (1, 0, ""), stage=stage)
        if finish_first:
            finish_image(image)
        path = tmp_path / f"{name}.pt"
        write_image(image, str(path), fsync=fsync)
        assert image.finished
        release_image(image)
        files.append(path.read_bytes())
    assert files[0] == files[1] == files[2]
    _, state = decode_image(read_image(str(tmp_path / "w.pt")), "x")  # checksums verified
    assert _equal(_state(), state.state_dict)
    assert state.state_dict["meta"] == {"step": 5, "names": ["a", "b"]}


def test_reused_pool_buffer_leaves_no_bytes_of_an_earlier_image(tmp_path):
    """A pooled buffer reused for another image: equal states still give equal files."""
    ones = {"t": torch.ones(1 << 18), "u": torch.full((999,), 7.0)}
    first = finish_image(start_image(BasicTensorAwareStateDict(ones), (1, 0, "")))
    release_image(first)
    small = {"t": torch.zeros(1 << 18), "u": torch.zeros(3)}
    image = finish_image(start_image(BasicTensorAwareStateDict(small), (1, 0, "")))
    write_image(image, str(tmp_path / "a.pt"))
    unstaged = finish_image(start_image(BasicTensorAwareStateDict(small), (1, 0, ""), stage=False))
    write_image(unstaged, str(tmp_path / "b.pt"))
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


@pytest.mark.parametrize(
    "device",
    CPU_AND_CUDA,
)
@pytest.mark.parametrize("fsync", [True, False])
@pytest.mark.parametrize("is_async", [False, True])
def test_manager_round_trip_is_bit_exact_on_every_path(tmp_path, device, fsync, is_async):
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    m = LocalCheckpointManager(tmp_path, "s", fsync=fsync)
    request = m.save(BasicTensorAwareStateDict(_state(device)), 1, is_async=is_async)
    if is_async:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.close()
    state, _ = LocalCheckpointManager(tmp_path, "s").load()
    got = state.state_dict
    assert all(got[k].device.type == device for k in got if isinstance(got[k], torch.Tensor))
    assert _equal(_state(device), got)


def test_durable_image_is_written_direct_and_fsynced(tmp_path, monkeypatch):
    import os

    from dist_checkpointing.local import _image

    calls: list = []
    real_write, real_fsync = _image.write_segments, os.fsync
    monkeypatch.setattr(
        _image,
        "write_segments",
        lambda *a, **k: (calls.append(("write", k["direct"], k["fsync"])), real_write(*a, **k))[1],
    )
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync",)), real_fsync(fd))[1])
    files = []
    for stage in (False, True):
        # unfinished: the sync save's part is hashed as it is written
        image = start_image(BasicTensorAwareStateDict(_state()), (1, 0, ""), stage=stage)
        write_image(image, str(tmp_path / f"{stage}.pt"), fsync=True)
        release_image(image)
        files.append((tmp_path / f"{stage}.pt").read_bytes())
    assert [c for c in calls if c[0] == "write"] == [("write", True, True)] * 2
    assert calls.count(("fsync",)) >= 2 and calls[-1] == ("fsync",)
    assert files[0] == files[1]
    _, state = decode_image(read_image(str(tmp_path / "False.pt")), "x")
    assert _equal(_state(), state.state_dict)
