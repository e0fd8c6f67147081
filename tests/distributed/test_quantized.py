"""Quantized wrapper subclasses (the `__tensor_flatten__` protocol) as ShardedTensor data on
2 gloo ranks: saved as their inner tensors, loaded bit for bit into quantized destinations,
resharded where the split keeps scaling blocks whole, refused with the block size where it
cuts one; loading into a plain tensor only with the dequantize opt-in.

torchao's own tensors run in tests/interop/test_torchao.py (a side venv)."""

from __future__ import annotations

import re
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.quantized import dequantize_on_load
from tests import _quant

pytestmark = pytest.mark.timeout(300)
WORLD = 2
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _cuts(kind: str, axis: Any) -> bool:
    return axis is not None and (_quant.SHAPE[axis] // WORLD) % _quant.BLOCKS[kind][axis] != 0


@st.composite
def _case(draw: Any) -> tuple:
    kind = draw(st.sampled_from(sorted(_quant.BLOCKS)))
    dtype = draw(st.sampled_from(DTYPES))
    backend = draw(st.sampled_from(["torch_dist", "async", "fully_parallel", "local"]))
    save_axis = draw(st.sampled_from([0, 1]))
    load_axis = save_axis if backend == "local" else draw(st.sampled_from([0, 1, None]))
    return kind, dtype, backend, save_axis, load_axis


@pytest.mark.timeout(400)
def test_quantized_round_trip_bitwise_or_refuse_cut_blocks(world_factory, tmp_path_factory):
    world = world_factory(WORLD)

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(_case(), min_size=8, max_size=8))
    def run(batch):
        results = world.run_ok(
            _quant.run_cases, batch, str(tmp_path_factory.mktemp("q")), timeout=200
        )
        assert results[0] == results[1], results
        for (kind, dtype, backend, save_axis, load_axis), got in zip(batch, results[0]):
            reshard = load_axis != save_axis
            if not reshard or not (_cuts(kind, save_axis) or _cuts(kind, load_axis)):
                assert got == "same", (kind, dtype, backend, save_axis, load_axis, got)
            else:  # a per-tensor or per-block scale cannot be split across its block
                assert re.search(r"'w\b.*block(s)? of \(?\d", got), (
                    kind,
                    backend,
                    save_axis,
                    load_axis,
                    got,
                )

    run()


#: (kind, save axis, load axis: None is the full tensor) and what the refusal must say
REFUSALS = [
    ("tensor", 0, None, "'w::scale'", "blocks of (4, 64) in the checkpoint, (8, 64) in the dest"),
    ("tensor", 0, 1, "'w::scale'", "blocks of (4, 64) in the checkpoint, (8, 32) in the dest"),
    ("tensor", 1, 0, "'w::scale'", "blocks of (8, 32) in the checkpoint, (4, 64) in the dest"),
    ("row", 0, 1, "'w::scale'", "blocks of (1, 64) in the checkpoint, (1, 32) in the dest"),
    ("row", 0, None, "'w::scale'", None),  # per-row scales reshard: loads, bit for bit
]


@pytest.mark.parametrize("backend", ["torch_dist", "fully_parallel"])
def test_refused_reshard_names_the_key_and_both_block_sizes(world_factory, tmp_path, backend):
    cases = [(k, torch.float8_e4m3fn, backend, s, ld) for k, s, ld, _, _ in REFUSALS]
    results = world_factory(WORLD).run_ok(_quant.run_cases, cases, str(tmp_path), timeout=120)
    for got, (kind, _, load_axis, key, blocks) in zip(results[0], REFUSALS):
        if blocks is None:
            assert got == "same", (kind, load_axis, got)
        else:
            assert key in got and blocks in got, (kind, load_axis, got)


def _rows_load_outcome(dest, rank, ckpt) -> str:
    """ "loaded", or the refusal's message, for a load of this rank's row half into `dest`."""
    try:
        dc.load({"w": ShardedTensor.from_rank_offsets("w", dest, (0, rank, 2))}, ckpt)
    except dc.CheckpointingException as e:
        return str(e)
    return "loaded"


def _plain_requests(ckpt: str) -> Dict[str, Any]:
    rank = dist.get_rank()
    q = _quant.quantize("mx", torch.float8_e4m3fn)
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", _quant.piece(q, "mx", 0, rank, 2), (0, rank, 2)
            )
        },
        ckpt,
    )
    want = (q.qdata.float() * q.scale.float().repeat_interleave(32, 1)).to(torch.bfloat16)
    out: Dict[str, Any] = {}

    def load(data: torch.Tensor, *offsets: Any) -> Any:
        sh = ShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=0 if offsets else rank)
        try:
            return dc.load({"w": sh}, ckpt)["w"]
        except dc.CheckpointingException as e:
            return str(e)

    out["refused"] = load(torch.zeros(8, 64, dtype=torch.bfloat16))
    with dequantize_on_load():
        got = load(torch.zeros(8, 32, dtype=torch.bfloat16), (1, rank, 2))
        out["dequantized"] = torch.equal(got, want[:, rank * 32 : (rank + 1) * 32])
        cut = torch.zeros(8, 16, dtype=torch.bfloat16)  # 4 pieces of 16 columns: cut 1x32 blocks
        out["cut"] = load(cut, (1, rank, 4))
    plain = ckpt + "_plain"
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", want[rank * 4 : rank * 4 + 4].clone(), (0, rank, 2)
            )
        },
        plain,
    )
    dest = _quant.empty_like_piece(_quant.piece(q, "mx", 0, rank, 2))
    out["reverse"] = _rows_load_outcome(dest, rank, plain)
    return out


def test_plain_destination_of_quantized_checkpoint_needs_dequantize_opt_in(world_factory, tmp_path):
    results = world_factory(WORLD).run_ok(_plain_requests, str(tmp_path / "c"), timeout=120)
    for r in results:
        assert "'w' is not in the checkpoint; it is stored quantized" in r["refused"]
        assert "dequantize_on_load" in r["refused"]
        assert r["dequantized"] is True
        assert "'w': the split at offset" in r["cut"] and "scaling block of 32" in r["cut"]
        assert "'w' is stored unquantized and is never quantized on load" in r["reverse"]


def _one_rank_cuts(ckpt: str) -> str:
    rank = dist.get_rank()
    q = _quant.quantize("block", torch.float8_e4m3fn)
    mine = _quant.piece(q, "block", 0, rank, 2)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", mine, (0, rank, 2))}, ckpt)
    if rank == 0:  # rows 0-4: whole 4-row blocks
        sh = ShardedTensor(
            "w", _quant.empty_like_piece(mine), torch.bfloat16, (4, 64), (8, 64), (0, 0), None
        )
    else:  # rows 5-8 with one scale row: blocks of 3 rows, the split at 5 cuts one
        dest = _quant.QTensor(
            torch.zeros(3, 64, dtype=torch.float8_e4m3fn), torch.zeros(1, 2), torch.bfloat16
        )
        sh = ShardedTensor("w", dest, torch.bfloat16, (3, 64), (8, 64), (5, 0), None)
    try:
        dc.load({"w": sh}, ckpt)
    except dc.CheckpointingException as e:
        return str(e)
    return "loaded"


def test_block_cut_on_one_rank_raises_on_every_rank(world_factory, tmp_path):
    results = world_factory(WORLD).run_ok(_one_rank_cuts, str(tmp_path / "c"), timeout=60)
    assert results[0] == results[1] and "failed on rank 1" in results[0], results
    assert (
        "'w': the split at offset 5 (length 3) of axis 0 cuts through a scaling block" in results[0]
    )


def _swizzled_loads(ckpt: str, backend: str) -> Dict[str, Any]:
    rank = dist.get_rank()
    q = _quant.quantize("mx", torch.float8_e4m3fn)
    save_strategy, load_strategy = _quant.strategies(backend)
    mine = _quant.swizzle(_quant.piece(q, "mx", 0, rank, 2))
    dc.save({"w": ShardedTensor.from_rank_offsets("w", mine, (0, rank, 2))}, ckpt, save_strategy)

    def load(want: Any, *offsets: Any) -> str:
        data = _quant.empty_like_piece(want)
        sh = ShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=0 if offsets else rank)
        try:
            out = dc.load({"w": sh}, ckpt, load_strategy)["w"]
        except dc.CheckpointingException as e:
            return str(e)
        return "same" if _quant.same(out, want) else "differs"

    out = {
        "keys": sorted(dc.load_tensors_metadata(ckpt)),
        "same split": load(mine, (0, rank, 2)),
        "full tensor": load(_quant.swizzle(q)),
        "columns": load(_quant.swizzle(_quant.piece(q, "mx", 1, rank, 2)), (1, rank, 2)),
        "unswizzled": load(_quant.piece(q, "mx", 0, rank, 2), (0, rank, 2)),
    }
    with dequantize_on_load():
        plain = torch.zeros(4, 64, dtype=torch.bfloat16)
        out["dequantized"] = _rows_load_outcome(plain, rank, ckpt)
    return out


@pytest.mark.parametrize("backend", ["torch_dist", "fully_parallel"])
def test_swizzled_scales_load_only_into_the_split_that_saved_them(world_factory, tmp_path, backend):
    results = world_factory(WORLD).run_ok(
        _swizzled_loads, str(tmp_path / "c"), backend, timeout=120
    )
    for r in results:
        assert r["keys"] == ["w::qdata", "w::scale[0:4,0:64]", "w::scale[4:8,0:64]"], r["keys"]
        assert r["same split"] == "same"
        for other in ("full tensor", "columns"):
            assert "'w::scale[" in r[other] and "is not in the checkpoint" in r[other], r[other]
            assert "'scale' of quantized 'w' is stored swizzled" in r[other], r[other]
            assert "'w::scale[0:4,0:64]', 'w::scale[4:8,0:64]'" in r[other], r[other]
        assert "'w::scale' is not in the checkpoint" in r["unswizzled"], r["unswizzled"]
        assert "stored swizzled" in r["unswizzled"], r["unswizzled"]
        assert "'w' is stored with swizzled scales" in r["dequantized"], r["dequantized"]
