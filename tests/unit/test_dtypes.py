"""Dtype conversion on load, judged by value: one that would change a value raises unless\nthe caller opts in."""

from __future__ import annotations

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.dtypes import is_exact_conversion
from dist_checkpointing.errors import CheckpointingException, LossyDtypeConversionError
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
#: (stored, requested, a value the conversion keeps, one it changes)
LOSSY = [
    (torch.float32, torch.int8, 2.0, 1.5),  # float -> int
    (torch.float32, torch.int64, -3.0, 0.5),
    (torch.float16, torch.int32, 2.0, 0.5),
    (torch.float32, torch.float16, 0.5, 0.1),  # wider -> narrower float
    (torch.float32, torch.bfloat16, 0.5, 0.1),
    (torch.float64, torch.float32, 0.5, 0.1),
    (torch.float16, torch.bfloat16, 0.5, 0.1),  # fewer mantissa bits
    (torch.bfloat16, torch.float16, 0.1, 1e6),  # smaller range
    (torch.int64, torch.int32, 2, 2**40),  # int -> narrower int
    (torch.int16, torch.int8, 2, 300),
    (torch.int8, torch.uint8, 2, -1),  # sign
    (torch.uint8, torch.int8, 2, 200),
    (torch.int64, torch.float64, 2**53, 2**53 + 1),  # beyond the mantissa
    (torch.int64, torch.float32, 2**24, 2**24 + 1),
    (torch.int32, torch.float32, -(2**24), 2**24 + 1),
    (torch.int16, torch.float16, 2048, 2049),
    (torch.int32, torch.bool, 1, 2),  # anything -> bool
    (torch.float32, torch.bool, 0.0, 0.5),
    (torch.complex64, torch.float32, 1 + 0j, 1 + 1j),
]


@pytest.mark.parametrize("stored, requested", EXACT, ids=lambda d: str(d).split(".")[-1])
def test_exact_conversions_are_allowed(stored, requested):
    assert is_exact_conversion(stored, requested)


@pytest.mark.parametrize("stored, requested", EXACT[:6], ids=lambda d: str(d).split(".")[-1])
def test_exact_conversions_keep_every_value(stored, requested):
    values = torch.arange(-8, 8).to(stored) if stored.is_signed else torch.arange(16).to(stored)
    assert torch.equal(values.to(requested).to(stored), values)


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("stored, requested, kept, changed", LOSSY, ids=str)
def test_a_conversion_loads_when_no_value_changes_and_names_the_first_that_would(
    tmp_path, stored, requested, kept, changed
):
    assert not is_exact_conversion(stored, requested)
    ok = torch.tensor([[kept, kept], [kept, kept]], dtype=stored)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", ok)}, tmp_path / "ok")
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2, dtype=requested))}
    assert torch.equal(dc.load(want, tmp_path / "ok")["w"].to(stored), ok)
    bad = torch.tensor([[kept, kept], [kept, changed]], dtype=stored)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", bad)}, tmp_path / "bad")
    with pytest.raises(LossyDtypeConversionError) as info:
        dc.load(want, tmp_path / "bad")
    text = str(info.value)
    assert f"'w' is stored as {stored} and requested as {requested}: the value " in text
    assert f"{bad[1, 1].item()} at index (1, 1) would become" in text
    assert "allow_lossy_dtype_conversion=True" in text


def test_megatron_cores_int64_saved_and_loaded_as_float32_loads_exactly(tmp_path):
    data = torch.arange(-1000, 1000, dtype=torch.int64)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", data)}, tmp_path / "c")
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2000, dtype=torch.float32))}
    assert torch.equal(dc.load(want, tmp_path / "c")["w"], data.to(torch.float32))


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


def test_tensor_requested_where_a_plain_value_is_stored_says_so(tmp_path):
    dc.save({"lr": 0.5, "w": ShardedTensor.from_rank_offsets("w", torch.ones(6))}, tmp_path / "c")
    want = {"lr": ShardedTensor.from_rank_offsets("lr", torch.zeros(6))}
    with pytest.raises(
        CheckpointingException, match="'lr' is stored as a plain value or object, not as a tensor"
    ):
        dc.load(want, tmp_path / "c")
