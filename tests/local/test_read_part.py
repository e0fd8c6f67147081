"""Reading a part verified as it lands (`local/_read.py`): bit-exact through the page cache
and O_DIRECT, and every kind of damage named."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.local import _read
from dist_checkpointing.local._image import decode_image, finish_image, start_image, write_image
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.storage import direct as storage_direct
from dist_checkpointing.storage import inflight


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(5 * (1 << 20) // 4 + 3, generator=g),  # spans several requests
        "empty": torch.empty(0),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "n": 3,
    }


def _write(tmp_path) -> str:
    names = ["big", "empty", "half"]
    image = finish_image(start_image(BasicTensorAwareStateDict(_state()), (1, 0, ""), names))
    path = str(tmp_path / "part.pt")
    write_image(image, path, fsync=False)
    return path


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("direct", [False, True])
def test_read_part_is_bit_exact_through_either_read_path(tmp_path, monkeypatch, direct, threads):
    path = _write(tmp_path)
    monkeypatch.setattr(_read, "prefer_direct_reads", lambda p: direct)
    monkeypatch.setattr(_read, "REQUEST", 1 << 20)
    monkeypatch.setattr(_read, "reader_threads", lambda n: threads)
    part = _read.read_part(path)
    with open(path, "rb") as f:
        assert part.buffer.numpy().tobytes() == f.read()
    assert part.buffer.data_ptr() % 4096 == 0 and part.pooled is None  # CPU destinations
    _, state = decode_image(part.buffer, path, verify=False)
    want = _state()
    assert all(torch.equal(state.state_dict[k], want[k]) for k in ("big", "empty", "half"))


@pytest.mark.parametrize("threads", [1, 3])
def test_read_part_names_the_damaged_tensor(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(_read, "reader_threads", lambda n: threads)
    path = _write(tmp_path)
    with open(path, "r+b") as f:
        f.seek(3 << 20)
        byte = f.read(1)
        f.seek(3 << 20)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch in tensor big"):
        _read.read_part(path)


@pytest.mark.parametrize("cut", [10, 200, 1 << 20])
def test_read_part_refuses_a_truncated_file(tmp_path, cut):
    path = _write(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(max(0, f.seek(0, 2) - cut))
    with pytest.raises(CheckpointCorruptedError, match="part.pt"):
        _read.read_part(path)


def test_read_part_refuses_a_damaged_header(tmp_path):
    path = _write(tmp_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    h_off = int.from_bytes(data[-40:-32], "little")
    data[h_off + 5] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="header or checksum table"):
        _read.read_part(path)


def test_reader_threads_follow_the_cores_per_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(_read.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert _read.reader_threads(4 << 30) == 4  # a GPU node: 16 cores for one rank
    assert _read.reader_threads(100 << 20) == 1  # under 64 MiB per thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(_read.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _read.reader_threads(4 << 30) == 2  # this CI machine kind: 2 cores, 2 ranks
    assert _read.reader_threads(100 << 20) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _read.reader_threads(4 << 30) == 1  # 2 cores, 4 ranks


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("use_direct", [False, True])
def test_read_part_keeps_the_storage_default_requests_in_flight(
    tmp_path, monkeypatch, use_direct, threads
):
    # the same rule as torch_dist loads: one request through the page cache, more with O_DIRECT
    path = _write(tmp_path)
    depths: list = []
    real = storage_direct.read_in_flight

    def spy(fd, offset, out, where, progress, request, depth):
        depths.append(depth)
        return real(fd, offset, out, where, progress, request, depth)

    monkeypatch.setattr(storage_direct, "read_in_flight", spy)
    monkeypatch.setattr(_read, "prefer_direct_reads", lambda p: use_direct)
    monkeypatch.setattr(_read, "reader_threads", lambda n: threads)
    part = _read.read_part(path)
    with open(path, "rb") as f:
        assert part.buffer.numpy().tobytes() == f.read()
    if use_direct and not storage_direct.direct_allowed(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    assert depths == [inflight.DEPTH if use_direct else storage_direct.BUFFERED_DEPTH] * threads
