"""Interop with megatron-core 0.19.2 (the newest release), both directions, resharded.

0.19 writes the common state as the ShardedObject `common_state` inside the `.distcp` files
(no `common.pt`) and a `metadata.json` without `common_backend`. Its wheels are built for
Python 3.12 only, but its `dist_checkpointing` is pure Python: .ci/run unpacks the wheels of
megatron-core 0.19.2 and nvidia-resiliency-ext 0.7.0 into a folder (`DIST_CKPT_MCORE19_PATH`,
put on PYTHONPATH) used by a Python 3.11 venv with torch 2.13 (`DIST_CKPT_MCORE19_PYTHON`).
Checked: tensors (resharded across the other axis), a prepended axis, ShardedObjects and
common state.
"""

from __future__ import annotations

import json
import os

import pytest

import dist_checkpointing as dc
from tests.interop import _launch
from tests.interop.test_megatron_core import load_mcore_checkpoint_resharded

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]
MCORE19 = _launch.mcore19()
requires_mcore19 = pytest.mark.skipif(
    MCORE19 is None,
    reason="megatron-core 0.19.2 is not set up: set DIST_CKPT_MCORE19_PYTHON (python 3.11 with "
    "torch==2.13.0 numpy psutil packaging pyyaml pynvml defusedxml triton) and "
    "DIST_CKPT_MCORE19_PATH (its unpacked py3.12 wheels plus nvidia-resiliency-ext 0.7.0's); "
    ".ci/run does",
)


@requires_mcore19
def test_we_load_megatron_core_019_checkpoint_resharded(world_factory, mcore019_jobs):
    job = mcore019_jobs["save"]  # 0.19's save, made once per session (`_side_jobs.py`)
    assert job.result == {"0": {"saved": True}, "1": {"saved": True}}
    ckpt = job.ckpt
    # the 0.19 layout: no common.pt, metadata.json without common_backend
    assert not os.path.exists(os.path.join(ckpt, "common.pt"))
    with open(os.path.join(ckpt, "metadata.json")) as f:
        assert "common_backend" not in json.load(f)
    assert dc.load_common_state_dict(ckpt) == {"iteration": 5}
    results = world_factory(2).run_ok(load_mcore_checkpoint_resharded, ckpt, timeout=240)
    assert results == [{"w": True, "layers": True, "obj": True, "iteration": True}] * 2


@requires_mcore19
def test_megatron_core_019_loads_our_checkpoint_resharded(mcore019_jobs):
    # our save of `save_for_mcore`, loaded by 0.19 in the session's side run
    result = mcore019_jobs["load"].result
    assert result == {
        str(r): {"w": True, "layers": True, "obj": True, "iteration": True} for r in range(2)
    }
