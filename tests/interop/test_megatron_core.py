"""Interop with megatron-core 0.16.1's torch_dist format, both directions, 2 ranks each.

megatron-core runs in its own interpreter (`DIST_CKPT_MCORE_PYTHON`, e.g. a venv made by
.ci/run) or in this one if it is importable here; our package never imports it.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from tests.interop import _launch

pytestmark = [pytest.mark.interop, pytest.mark.timeout(300)]
MCORE_PYTHON = _launch.mcore_python()
requires_mcore = pytest.mark.skipif(
    MCORE_PYTHON is None,
    reason="megatron-core is not installed: set DIST_CKPT_MCORE_PYTHON to a python with megatron-core==0.16.1 and psutil (.ci/run does)",
)


def _expected():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    stack = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    return full, stack


def load_mcore_checkpoint_resharded(ckpt: str) -> Dict[str, bool]:
    rank = dist.get_rank()
    full, stack = _expected()
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, rank, 2)),
        "layers": ShardedTensor.from_rank_offsets(
            "layers", torch.zeros(3, 4, dtype=torch.bfloat16), (0, rank, 2), prepend_axis_num=1
        ),
        "obj": ShardedObject("rng", None, (2,), (rank,)),
    }
    out = dc.load(request, ckpt)
    return {
        "w": bool(torch.equal(out["w"], full[:, rank * 3 : (rank + 1) * 3])),
        "layers": bool(torch.equal(out["layers"], stack[rank])),
        "obj": out["obj"] == {"seed": rank},
        "iteration": out["iteration"] == 5,
    }


def save_for_mcore(ckpt: str) -> None:
    rank = dist.get_rank()
    full, stack = _expected()
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", full[rank * 4 : (rank + 1) * 4].clone(), (0, rank, 2)
            ),
            "layers": ShardedTensor.from_rank_offsets(
                "layers", stack[rank].clone(), (0, rank, 2), prepend_axis_num=1
            ),
            "obj": ShardedObject("rng", {"seed": rank}, (2,), (rank,)),
            "iteration": 5,
        },
        ckpt,
    )


@requires_mcore
def test_we_load_megatron_core_checkpoint_resharded(world_factory, mcore016_jobs):
    job = mcore016_jobs["save"]  # megatron's save, made once per session (`_side_jobs.py`)
    assert job.result == {"0": {"saved": True}, "1": {"saved": True}}
    assert dc.check_is_distributed_checkpoint(job.ckpt)
    results = world_factory(2).run_ok(load_mcore_checkpoint_resharded, job.ckpt, timeout=180)
    assert results == [{"w": True, "layers": True, "obj": True, "iteration": True}] * 2


@requires_mcore
def test_megatron_core_loads_our_checkpoint_resharded(mcore016_jobs):
    # our save of `save_for_mcore`, loaded by megatron in the session's side run
    result = mcore016_jobs["load"].result
    assert result == {
        str(r): {"w": True, "layers": True, "obj": True, "iteration": True} for r in range(2)
    }
