"""Column blocks read once per node into shared windows (`shared_read`), in real worlds:
bit-exact loads, damage detected on every rank, a failing rank stopping its peers, and
nothing left in /dev/shm."""

from __future__ import annotations

import errno
import os
from typing import Dict, Tuple, Union

import pytest
import torch
import torch.distributed
from torch.distributed.checkpoint import FileSystemReader

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.storage import buffers, direct, faults, node_share
from dist_checkpointing.strategies.torch_dist import shared_read
from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy
from tests.distributed._rank_fns import rank

pytestmark = pytest.mark.skipif(
    not node_share.available(), reason="needs /dev/shm and POSIX semaphores"
)

#: rows of 996 float32 (3984 bytes): rows straddle the windows (8 KiB; 16 KiB at 2 ranks)
ROWS, COLS = 96, 996
SMALL = {
    "MIN_SHARED": 1,
    "MIN_CONSUMERS": 2,
    "WINDOW": 8192,
    "SLACK": 0,
    "PRE": 8192,
}


def full(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(ROWS, COLS, generator=g)


def save_rows(path: str) -> None:
    r, w = rank(), torch.distributed.get_world_size()
    b = ROWS // w
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"t{i}", full(i)[r * b : (r + 1) * b].clone(), (0, r, w)
        )
        for i in range(3)
    }
    dc.save(sd, path)


def load_cols(
    path: str,
    dtype: torch.dtype = torch.float32,
    fail_rank: int = -1,
    staged: bool = True,
    read_error: bool = False,
    buffered: bool = False,
) -> Dict[str, Union[bool, int]]:
    """Loads column blocks through small shared windows; returns which tensors match, under
    "staged" how many huge-page staging buffers this rank made, under "landed" how many
    windows it copied in from a staging buffer, and under "opened" how many chunks' zip
    records it read on their own instead of taking them from the windows. `staged=False` withholds huge pages,
    `buffered=True` has the checkpoint's directory refuse O_DIRECT."""
    r, w = rank(), torch.distributed.get_world_size()
    c = COLS // w
    saved = {k: getattr(shared_read, k) for k in SMALL}
    for k, v in SMALL.items():
        setattr(shared_read, k, v)
    real_copy, real_staging, real_land = shared_read._copy_rows, buffers.staging, shared_read._land
    real_open = shared_read.open_range
    stages = []
    landed = []
    opened = []

    def counted_open(*args, **kwargs):  # the records read on their own
        opened.append(1)
        return real_open(*args, **kwargs)

    def counted_land(*args, **kwargs):
        landed.append(1)
        return real_land(*args, **kwargs)

    def failing_copy(*args, **kwargs):  # a consumer that fails half-way
        raise RuntimeError("injected failure")

    def counted_staging(nbytes):
        got = real_staging(nbytes) if staged else None
        stages.append(got is not None)
        return got

    if r == fail_rank:
        shared_read._copy_rows = failing_copy
    buffers.staging = counted_staging
    shared_read._land = counted_land
    shared_read.open_range = counted_open
    if buffered:
        direct.refuse_direct(path, OSError(errno.EINVAL, "refused by the test"), "reads")
    fault = faults.Fault("*.distcp", ops=("read",), error=OSError(5, "injected read error"))
    if read_error:
        faults.inject(fault)
    try:
        req = {
            f"t{i}": ShardedTensor.from_rank_offsets(
                f"t{i}", torch.zeros(ROWS, c, dtype=dtype), (1, r, w)
            )
            for i in range(3)
        }
        out = dc.load(req, path, sharded_strategy=TorchDistLoadShardedStrategy(shared_reads=True))
    finally:
        if read_error:
            faults.remove(fault)
        shared_read._copy_rows, buffers.staging = real_copy, real_staging
        shared_read._land, shared_read.open_range = real_land, real_open
        direct.reset_direct_fallbacks()
        for k, v in saved.items():
            setattr(shared_read, k, v)
    same = {
        k: torch.equal(v, full(int(k[1:]))[:, r * c : (r + 1) * c].to(dtype))
        for k, v in out.items()
    }
    return {**same, "staged": sum(stages), "landed": len(landed), "opened": len(opened)}


def ours_in_shm() -> int:
    """Segments of this process left in /dev/shm."""
    mark = f"{node_share.PREFIX}-{os.getpid()}-"
    return sum(n.startswith(mark) for n in os.listdir(node_share.SHM_DIR))


def damage(path: str, where: str = "data") -> None:
    """Flips one byte of the first data file: in the middle of its data, or in the zip
    records before ("head": the time in its local file header, which leaves the records
    parseable) or after ("tail") the data of its first item."""
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    items = [
        info
        for info in FileSystemReader(path).read_metadata().storage_data.values()
        if info.relative_path == name
    ]
    first = min(items, key=lambda info: info.offset)
    at = {
        "data": os.path.getsize(os.path.join(path, name)) // 2,
        "head": first.offset + 10,
        "tail": first.offset + first.length - 10,
    }[where]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_column_blocks_load_bit_exactly_and_nothing_is_left_in_shared_memory(
    world, world_factory, tmp_path
):
    path = str(tmp_path / "ckpt")
    w = world_factory(world)
    w.run_ok(save_rows, path, timeout=60)
    ok = {"t0": True, "t1": True, "t2": True}
    # float64: converted while copied out; staged False: private staging buffers;
    # buffered: O_DIRECT refused, reads straight into the windows
    for dtype, staged, buffered in (
        (torch.float32, True, False),
        (torch.float64, True, False),
        (torch.float32, False, False),
        (torch.float32, True, True),
    ):
        got = w.run_ok(load_cols, path, dtype, -1, staged, False, buffered, timeout=60)
        assert [{k: g[k] for k in ok} for g in got] == [ok] * world
        used = sum(g["staged"] for g in got)
        # each rank reads its own file, into AHEAD + 1 staging buffers (in huge pages where
        # the kernel gives them) unless it reads buffered
        assert used == (
            (shared_read.AHEAD + 1) * world
            if staged and not buffered and buffers.huge_pages()
            else 0
        ), got
        assert all((g["landed"] > 0) != buffered for g in got), got
        # the records around each chunk's data come with its windows (checksums on)
        assert [g["opened"] for g in got] == [0] * world, got
    assert w.run_ok(ours_in_shm, timeout=30) == [0] * world


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["data", "head", "tail"])
def test_a_damaged_chunk_fails_the_load_on_every_rank(where, world_factory, tmp_path):
    path = str(tmp_path / "ckpt")
    w = world_factory(2)
    w.run_ok(save_rows, path, timeout=60)
    damage(path, where)
    outcomes = w.run(load_cols, path, timeout=60)
    for o in outcomes:
        assert isinstance(o.error, dc.CheckpointingException), o.trace
        assert "checksum mismatch" in str(o.error)
    assert w.run_ok(ours_in_shm, timeout=30) == [0, 0]


@pytest.mark.timeout(240)
def test_a_failing_read_ahead_fails_the_load_on_every_rank(world_factory, tmp_path):
    path = str(tmp_path / "ckpt")
    w = world_factory(2)
    w.run_ok(save_rows, path, timeout=60)
    outcomes = w.run(load_cols, path, torch.float32, -1, True, True, timeout=60)
    for o in outcomes:
        assert isinstance(o.error, dc.CheckpointingException), o.trace
        assert "injected read error" in str(o.error)
    assert w.run_ok(ours_in_shm, timeout=30) == [0, 0]
    assert w.run_ok(load_cols, path, timeout=60)[0]["t0"]


@pytest.mark.timeout(240)
def test_a_rank_failing_mid_read_stops_its_peers_instead_of_hanging_them(world_factory, tmp_path):
    path = str(tmp_path / "ckpt")
    w = world_factory(3)
    w.run_ok(save_rows, path, timeout=60)
    outcomes = w.run(load_cols, path, torch.float32, 1, timeout=60)
    for o in outcomes:
        assert isinstance(o.error, dc.CheckpointingException), o.trace
        assert "injected failure" in str(o.error)  # the cause, reported on every rank
    assert w.run_ok(ours_in_shm, timeout=30) == [0, 0, 0]
    got = w.run_ok(load_cols, path, timeout=60)
    assert [(g["t0"], g["t1"], g["t2"]) for g in got] == [(True, True, True)] * 3


def exchanges_of_a_load(path: str) -> Tuple[int, int]:
    """Loads column blocks (shared reads on); returns the exchanges the strategy made, and
    those of the whole load."""
    from dist_checkpointing import _dist
    from dist_checkpointing.strategies.torch_dist import load as load_mod

    real_gather, real_load = _dist.all_gather_pickled, load_mod.TorchDistLoadShardedStrategy.load
    calls = []
    inside = []

    def counted(*args, **kwargs):
        calls.append(bool(inside))
        return real_gather(*args, **kwargs)

    def load(self, *args, **kwargs):
        inside.append(1)
        try:
            return real_load(self, *args, **kwargs)
        finally:
            inside.pop()

    _dist.all_gather_pickled = counted
    load_mod.TorchDistLoadShardedStrategy.load = load
    try:
        got = load_cols(path)
    finally:
        _dist.all_gather_pickled = real_gather
        load_mod.TorchDistLoadShardedStrategy.load = real_load
    assert got["t0"] and got["t1"] and got["t2"]
    return sum(calls), len(calls)


@pytest.mark.timeout(240)
def test_a_load_makes_four_exchanges(world_factory, tmp_path):
    # each exchange of a 4-rank load cost 3-10 ms: the strategies' selection carries the
    # common state's outcome; the request's validation; in the strategy, one exchange for
    # the read-path measurement and the shared-read offers, one for the outcome
    path = str(tmp_path / "ckpt")
    w = world_factory(2)
    w.run_ok(save_rows, path, timeout=60)
    assert w.run_ok(exchanges_of_a_load, path, timeout=60) == [(2, 4), (2, 4)]
