"""A load reads only the bytes of the requested boxes of each stored chunk (seen through the
storage seam's read spy), and every byte it returns is verified when the checkpoint has
checksums: a partly read 4 MiB block is read whole to check its digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.storage import faults
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests._rss import run_script

Box = Tuple[Sequence[int], Sequence[int]]  # (offsets, lengths)


def _layers() -> torch.Tensor:
    """4 layers of 2048 x 1024 fp32: 8 MiB per layer, two 4 MiB checksum blocks each."""
    return torch.arange(4 * 2048 * 1024, dtype=torch.float32).reshape(4, 2048, 1024)


def _load(ckpt: Path, key: str, shape: Sequence[int], boxes: List[Box], verify: bool = True):
    req = {
        f"r{i}": ShardedTensor(
            key,
            torch.zeros(tuple(n), dtype=torch.float32),
            torch.float32,
            tuple(n),
            tuple(shape),
            tuple(o),
            None,
        )
        for i, (o, n) in enumerate(boxes)
    }
    strategy = TorchDistLoadShardedStrategy(verify_checksums=verify)
    with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
        got = dc.load(req, ckpt, strategy, validate_access_integrity=False)
    return [got[f"r{i}"] for i in range(len(boxes))], spy.calls


def _box(t: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(*box)):
        t = t.narrow(dim, o, n)
    return t


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> Tuple[Path, torch.Tensor]:
    w = _layers()
    ckpt = tmp_path_factory.mktemp("layers") / "c"
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, ckpt)
    return ckpt, w


def test_rows_of_one_layer_are_read_without_the_rest_of_the_layer(layered):
    ckpt, w = layered
    box = ((2, 512, 0), (1, 256, 1024))  # 1 MiB of the 32 MiB chunk's 8 MiB layer 2
    (got,), calls = _load(ckpt, "w", w.shape, [box])
    assert torch.equal(got, _box(w, box))
    assert sum(c.nbytes for c in calls) == 256 * 1024 * 4


def test_unverified_loads_read_each_row_range_and_column_run_alone(layered):
    ckpt, w = layered
    boxes = [((1, 0, 0), (1, 128, 1024)), ((1, 1024, 0), (1, 128, 1024))]  # two query groups
    got, calls = _load(ckpt, "w", w.shape, boxes, verify=False)
    assert all(torch.equal(g, _box(w, b)) for g, b in zip(got, boxes))
    assert [c.nbytes for c in calls] == [128 * 1024 * 4] * 2
    cols = ((3, 0, 0), (1, 4, 256))  # the first quarter of 4 rows: 4 runs 3 KiB apart
    (got,), calls = _load(ckpt, "w", w.shape, [cols], verify=False)
    assert torch.equal(got, _box(w, cols))
    assert sum(c.nbytes for c in calls) <= 4 * 4096  # runs under a page apart read as one


def test_damage_in_a_partly_read_checksum_block_is_caught(tmp_path):
    w = _layers()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    data = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp" and p.stat().st_size)
    raw = bytearray(data.read_bytes())
    start = raw.index(w[0, 0].numpy().tobytes()[:64])  # the data region
    row_bytes = 1024 * 4
    raw[start + (2 * 2048 + 900) * row_bytes + 8] ^= 0xFF  # layer 2, row 900: block 4
    data.write_bytes(bytes(raw))
    rows = ((2, 512, 0), (1, 256, 1024))  # rows 512-767 of layer 2: block 4 too
    with pytest.raises(CheckpointCorruptedError, match=r"checksum mismatch in data block 4"):
        _load(tmp_path / "c", "w", w.shape, [rows])
    other = ((2, 1024, 0), (1, 256, 1024))  # block 5: not damaged, read without error
    (got,), _ = _load(tmp_path / "c", "w", w.shape, [other])
    assert torch.equal(got, _box(w, other))


_SHAPE = (5, 24, 40)  # float32: 160-byte rows, 3.75 KiB layers


@st.composite
def _boxes(draw: st.DrawFn) -> List[Box]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        offsets, lengths = [], []
        for s in _SHAPE:
            o = draw(st.integers(0, s - 1))
            offsets.append(o)
            lengths.append(draw(st.integers(1, s - o)))
        out.append((offsets, lengths))
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Dict[str, Path]:
    w = torch.randn(_SHAPE)
    root = tmp_path_factory.mktemp("small")
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, root / "c")
    torch.save(w, root / "w.pt")
    return {"ckpt": root / "c", "w": root / "w.pt"}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(boxes=_boxes(), verify=st.booleans())
def test_any_boxes_of_a_chunk_load_their_exact_values(small, boxes, verify):
    w = torch.load(small["w"], weights_only=True)
    got, calls = _load(small["ckpt"], "w", _SHAPE, boxes, verify=verify)
    for g, b in zip(got, boxes):
        assert torch.equal(g, _box(w, b)), b
    if not verify:  # never more than the boxes' rows' extents
        extent = sum(torch.zeros(_SHAPE)[b[0][0] : b[0][0] + b[1][0]].numel() for b in boxes)
        assert sum(c.nbytes for c in calls) <= extent * 4


@st.composite
def _layer_boxes(draw: st.DrawFn) -> List[Box]:
    """Boxes of the layered tensor: rows of some layers, some with a column range."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        layer = draw(st.integers(0, 3))
        r0 = draw(st.integers(0, 2047))
        rows = draw(st.integers(1, min(600, 2048 - r0)))
        c0, cols = (0, 1024) if draw(st.booleans()) else (draw(st.integers(0, 1000)), 24)
        out.append(((layer, r0, c0), (1, rows, cols)))
    return out


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(boxes=_layer_boxes(), verify=st.booleans())
def test_boxes_across_checksum_blocks_load_their_exact_values(layered, boxes, verify):
    ckpt, w = layered
    got, _ = _load(ckpt, "w", w.shape, boxes, verify=verify)
    for g, b in zip(got, boxes):
        assert torch.equal(g, _box(w, b)), b


_EDGE_RSS = Path(__file__).with_name("_edge_rss.py")


def test_completing_a_partly_read_checksum_block_needs_little_memory(tmp_path):
    ckpt = str(tmp_path / "c")
    run_script(_EDGE_RSS, "save", ckpt)
    # a row 2 MiB into a 4 MiB block: its 4 MiB outside the row are hashed a piece at a time
    measured = json.loads(run_script(_EDGE_RSS, "load", ckpt).strip().splitlines()[-1])
    assert measured["exact"], measured
    assert measured["growth"] <= 2 << 20, measured
