"""A part file read back (`read_image` + `decode_image`, as `load` does): bit-exact, and
every kind of damage named."""

from __future__ import annotations

import pytest
import torch

from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.local._image import (
    decode_image,
    finish_image,
    read_image,
    start_image,
    write_image,
)
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict


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


def _load(path: str):
    return decode_image(read_image(path), path)[1]


def test_part_file_is_bit_exact(tmp_path):
    path = _write(tmp_path)
    with open(path, "rb") as f:
        assert read_image(path).numpy().tobytes() == f.read()
    state, want = _load(path), _state()
    assert all(torch.equal(state.state_dict[k], want[k]) for k in ("big", "empty", "half"))


def test_damaged_part_names_the_tensor(tmp_path):
    path = _write(tmp_path)
    with open(path, "r+b") as f:
        f.seek(3 << 20)
        byte = f.read(1)
        f.seek(3 << 20)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch in tensor big"):
        _load(path)


@pytest.mark.parametrize("cut", [10, 200, 1 << 20])
def test_truncated_part_is_refused(tmp_path, cut):
    path = _write(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(max(0, f.seek(0, 2) - cut))
    with pytest.raises(CheckpointCorruptedError, match="part.pt"):
        _load(path)


def test_damaged_header_is_refused(tmp_path):
    path = _write(tmp_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    h_off = int.from_bytes(data[-40:-32], "little")
    data[h_off + 5] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="header checksum mismatch"):
        _load(path)
