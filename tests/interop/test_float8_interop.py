"""Plain float8 tensors (float8_e4m3fn, float8_e5m2, float8_e8m0fnu; every byte value, NaN
and infinity patterns included) between us, megatron-core 0.16.1 and stock PyTorch DCP, both
directions, 2 ranks: saved row-split, loaded column-split (or whole), bit for bit.

megatron-core runs in its side interpreter (see tests/interop/_launch.py); DCP is torch's own.
"""

from __future__ import annotations

import os
from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.core import CheckpointingConfig, save_config
from tests.interop.mcore_side import float8_tensors
from tests.interop.test_megatron_core import requires_mcore

pytestmark = [pytest.mark.interop, pytest.mark.timeout(300)]
WORLD = 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    return {
        k: got[k].dtype == want[k].dtype and bool(torch.equal(_bits(got[k]), _bits(want[k])))
        for k in want
    }


def _rows(rank: int) -> Dict[str, torch.Tensor]:
    return {k: t.chunk(WORLD, 0)[rank].clone() for k, t in float8_tensors().items()}


def _cols(rank: int) -> Dict[str, torch.Tensor]:
    return {k: t.chunk(WORLD, 1)[rank].contiguous() for k, t in float8_tensors().items()}


def save_rows(ckpt: str) -> None:
    """Ours: each rank saves its rows of every float8 tensor."""
    rank = dist.get_rank()
    dc.save(
        {
            k: ShardedTensor.from_rank_offsets(k, t, (0, rank, WORLD))
            for k, t in _rows(rank).items()
        },
        ckpt,
    )


def load_cols(ckpt: str) -> Dict[str, bool]:
    """Ours: each rank loads its columns of every float8 tensor; bit for bit per key."""
    rank = dist.get_rank()
    want = _cols(rank)
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t), (1, rank, WORLD))
        for k, t in want.items()
    }
    return _same(dc.load(request, ckpt), want)


def dcp_loads_whole(ckpt: str) -> Dict[str, bool]:
    """Stock DCP: every rank loads the whole tensors of a checkpoint of ours."""
    want = float8_tensors()
    target = {k: torch.empty_like(t) for k, t in want.items()}
    dcp.load(target, checkpoint_id=ckpt)
    return _same(target, want)


def dcp_saves_rows(ckpt: str) -> None:
    """Stock DCP: each rank saves its rows (DTensors sharded on dim 0), then the checkpoint is
    adopted as ours: an empty common state and a metadata.json naming torch_dist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    state = {
        k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in _rows(rank).items()
    }
    dcp.save(state, checkpoint_id=ckpt)
    if rank == 0:
        torch.save({}, os.path.join(ckpt, "common.pt"))
        save_config(CheckpointingConfig("torch_dist", 1), ckpt)
    dist.barrier()


@pytest.mark.parametrize(
    "saver,loader",
    [(save_rows, dcp_loads_whole), (dcp_saves_rows, load_cols)],
    ids=["stock_dcp_reads_ours", "we_read_stock_dcp_resharded"],
)
def test_float8_checkpoints_cross_between_us_and_stock_dcp_bit_for_bit(
    saver, loader, world_factory, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    world = world_factory(WORLD)
    world.run_ok(saver, ckpt, timeout=120)
    assert (
        world.run_ok(loader, ckpt, timeout=120) == [dict.fromkeys(float8_tensors(), True)] * WORLD
    )


@requires_mcore
def test_megatron_core_reads_our_float8_checkpoint_resharded(mcore016_jobs):
    # our save of `save_rows`, loaded by megatron in the session's side run (`_side_jobs.py`)
    result = mcore016_jobs["load-f8"].result
    assert result == {str(r): dict.fromkeys(float8_tensors(), True) for r in range(WORLD)}


@requires_mcore
def test_we_read_a_megatron_core_float8_checkpoint_resharded(world_factory, mcore016_jobs):
    job = mcore016_jobs["save-f8"]
    assert job.result == {str(r): {"saved": True} for r in range(WORLD)}
    got = world_factory(WORLD).run_ok(load_cols, job.ckpt, timeout=120)
    assert got == [dict.fromkeys(float8_tensors(), True)] * WORLD
