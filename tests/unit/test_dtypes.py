"""Dtype conversion on load: exact ones load, lossy ones raise unless the caller opts in."""

from __future__ import annotations

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.dtypes import check_dtype_conversion, is_exact_conversion
from dist_checkpointing.errors import LossyDtypeConversionError
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

EXACT = [
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float64),
    (torch.float16, torch.float64),
    (torch.int8, torch.int16),
    (torch.int8, torch.int64),
    (torch.int32, torch.int64),
    (torch.uint8, torch.int16),
    (torch.int8, torch.float16),
    (torch.uint8, torch.bfloat16),
    (torch.int16, torch.float32),
    (torch.int32, torch.float64),
    (torch.bool, torch.int8),
    (torch.bool, torch.float32),
    (torch.float32, torch.complex64),
    (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e5m2, torch.float16),
]
LOSSY = [
    (torch.float32, torch.int8),  # float -> int
    (torch.float32, torch.int64),
    (torch.float16, torch.int32),
    (torch.float32, torch.float16),  # wider -> narrower float
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.float32),
    (torch.float16, torch.bfloat16),  # fewer mantissa bits
    (torch.bfloat16, torch.float16),  # smaller range
    (torch.int64, torch.int32),  # int -> narrower int
    (torch.int16, torch.int8),
    (torch.int8, torch.uint8),  # sign
    (torch.uint8, torch.int8),
    (torch.int64, torch.float64),  # beyond 2**53
    (torch.int32, torch.float32),
    (torch.int16, torch.float16),
    (torch.int32, torch.bool),  # anything -> bool
    (torch.float32, torch.bool),
    (torch.complex64, torch.float32),
]


@pytest.mark.parametrize("stored, requested", EXACT, ids=lambda d: str(d).split(".")[-1])
def test_exact_conversions_are_allowed(stored, requested):
    assert is_exact_conversion(stored, requested)
    assert check_dtype_conversion("k", stored, requested) is False


@pytest.mark.parametrize("stored, requested", LOSSY, ids=lambda d: str(d).split(".")[-1])
def test_lossy_conversions_raise_naming_key_and_both_dtypes(stored, requested):
    assert not is_exact_conversion(stored, requested)
    with pytest.raises(LossyDtypeConversionError) as info:
        check_dtype_conversion("layer.w", stored, requested)
    assert f"'layer.w' is stored as {stored} and requested as {requested}" in str(info.value)
    assert "allow_lossy_dtype_conversion=True" in str(info.value)
    assert check_dtype_conversion("layer.w", stored, requested, allow_lossy=True) is True


@pytest.mark.parametrize("stored, requested", EXACT[:6], ids=lambda d: str(d).split(".")[-1])
def test_exact_conversions_keep_every_value(stored, requested):
    values = torch.arange(-8, 8).to(stored) if stored.is_signed else torch.arange(16).to(stored)
    assert torch.equal(values.to(requested).to(stored), values)


def _saved(tmp_path, dtype):
    data = (torch.arange(6, dtype=torch.float32) * 1.37).to(dtype)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", data)}, tmp_path / "c")
    return data


def _want(dtype):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, dtype=dtype))}


def test_load_refuses_float32_into_int8_on_every_path(tmp_path):
    _saved(tmp_path, torch.float32)
    with pytest.raises(
        LossyDtypeConversionError,
        match="'w' is stored as torch.float32 and requested as torch.int8",
    ):
        dc.load(_want(torch.int8), tmp_path / "c")


def test_load_converts_lossy_when_the_caller_opts_in(tmp_path, caplog):
    data = _saved(tmp_path, torch.float32)
    out = dc.load(_want(torch.int8), tmp_path / "c", allow_lossy_dtype_conversion=True)
    assert torch.equal(out["w"], data.to(torch.int8)) and "lossy conversion" in caplog.text
    strategy = TorchDistLoadShardedStrategy(allow_lossy_dtype_conversion=True)
    out = dc.load(_want(torch.bfloat16), tmp_path / "c", sharded_strategy=strategy)
    assert torch.equal(out["w"], data.to(torch.bfloat16))


def test_load_widens_exactly_without_opt_in(tmp_path, caplog):
    data = _saved(tmp_path, torch.bfloat16)
    out = dc.load(_want(torch.float32), tmp_path / "c")
    assert torch.equal(out["w"], data.to(torch.float32)) and "lossy" not in caplog.text


def test_missing_tensor_names_close_keys(tmp_path):
    _saved(tmp_path, torch.float32)
    want = {"w2": ShardedTensor.from_rank_offsets("w2", torch.zeros(6))}
    with pytest.raises(
        Exception, match=r"'w2' is not in the checkpoint \(closest keys in the checkpoint: 'w'\)"
    ):
        dc.load(want, tmp_path / "c")
