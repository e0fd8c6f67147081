"""Loading flattened-range checkpoints that megatron-core 0.13.1 itself wrote.

megatron-core 0.13.1 runs in its own interpreter (`DIST_CKPT_MCORE013_PYTHON`, a venv made
by .ci/run) and saves distributed-optimizer style flat shards with its own
`ShardedTensor.from_rank_offsets_flat` on 2 ranks (`mcore013_side.py`). We load them on 1, 2
and 4 ranks, unflattened and flat with other ranges, and list their original shapes.
"""

from __future__ import annotations

from typing import Dict, List, Set

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from tests.interop import _launch, _side_jobs
from tests.interop.mcore013_side import expected

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]
SIDE = _launch.side_script("mcore013_side.py")
MCORE013_PYTHON = _launch.mcore013_python()
requires_mcore013 = pytest.mark.skipif(
    MCORE013_PYTHON is None,
    reason="megatron-core 0.13 is not installed: set DIST_CKPT_MCORE013_PYTHON to a python with "
    "megatron-core==0.13.1, psutil and packaging (.ci/run does)",
)


def _save_with_mcore013(ckpt: str) -> str:
    assert MCORE013_PYTHON is not None
    # megatron 0.13 saves slowly on a loaded CPU
    _launch.run_side(MCORE013_PYTHON, [SIDE, ckpt], timeout=600)
    return ckpt


def start_in_background(tmp_path_factory: pytest.TempPathFactory, fixtures: Set[str]) -> None:
    """Starts megatron-core 0.13's save when a selected test of this module needs it."""
    if MCORE013_PYTHON is not None and "mcore013_checkpoint" in fixtures:
        ckpt = str(tmp_path_factory.mktemp("mcore013") / "ckpt")
        _side_jobs.in_background("mcore013", lambda: _save_with_mcore013(ckpt))


@pytest.fixture(scope="module")
def mcore013_checkpoint(tmp_path_factory) -> str:
    return _side_jobs.wait_for(
        "mcore013",
        lambda: _save_with_mcore013(str(tmp_path_factory.mktemp("mcore013") / "ckpt")),
    )


def load_unflattened(ckpt: str) -> List[str]:
    """Rank function: each rank loads a column block of every tensor (not flat)."""
    r, w = dist.get_rank(), dist.get_world_size()
    problems = []
    for key, full in expected().items():
        cols = full.shape[-1] // w if full.shape[-1] % w == 0 else None
        if cols is None:  # fall back to whole tensors where columns do not divide
            request = ShardedTensor.from_rank_offsets(key, torch.zeros_like(full), replica_id=r)
            want = full
        else:
            request = ShardedTensor.from_rank_offsets(
                key,
                torch.zeros(*full.shape[:-1], cols, dtype=full.dtype),
                (full.ndim - 1, r, w),
            )
            want = full[..., r * cols : (r + 1) * cols]
        got = dc.load({"t": request, "iteration": None}, ckpt)
        if not torch.equal(got["t"], want) or got["iteration"] != 7:
            problems.append(f"rank {r} {key}: {got['t']} != {want}")
    return problems


def load_flat(ckpt: str) -> List[str]:
    """Rank function: flat requests with ranges and grids other than the saved ones."""
    r, w = dist.get_rank(), dist.get_world_size()
    full = expected()["opt.a"]  # (8, 6): rows split in w pieces, each flat range cut at 5
    rows = 8 // w
    piece = full[r * rows : (r + 1) * rows].flatten()
    request = {
        "head": ShardedTensor.from_rank_offsets_flat(
            "opt.a", torch.zeros(5), (rows, 6), (0, r, w), flattened_range=slice(0, 5)
        ),
        "tail": ShardedTensor.from_rank_offsets_flat(
            "opt.a",
            torch.zeros(rows * 6 - 5),
            (rows, 6),
            (0, r, w),
            flattened_range=slice(5, rows * 6),
        ),
    }
    got = dc.load(request, ckpt)
    problems = []
    if not torch.equal(got["head"], piece[:5]) or not torch.equal(got["tail"], piece[5:]):
        problems.append(f"rank {r}: {got} != {piece}")
    return problems


def tensors_metadata(ckpt: str) -> Dict[str, tuple]:
    return {k: (v.global_shape, str(v.dtype)) for k, v in dc.load_tensors_metadata(ckpt).items()}


@requires_mcore013
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_we_load_flat_checkpoints_megatron_013_wrote(
    world_size, world_factory, mcore013_checkpoint
):
    world = world_factory(world_size)
    assert world.run_ok(load_unflattened, mcore013_checkpoint, timeout=150) == [[]] * world_size
    assert world.run_ok(load_flat, mcore013_checkpoint, timeout=150) == [[]] * world_size


@requires_mcore013
def test_metadata_of_megatron_013_flat_checkpoint_is_the_unflattened_one(mcore013_checkpoint):
    want = {k: (tuple(v.shape), str(v.dtype)) for k, v in expected().items()}
    assert tensors_metadata(mcore013_checkpoint) == want
    loaded = dc.load_plain_tensors(mcore013_checkpoint)
    assert all(torch.equal(loaded[k], v) for k, v in expected().items())
