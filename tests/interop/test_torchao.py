"""torchao's Float8Tensor and MXTensor through save/load and the manager, 2 ranks.

torchao runs in its own interpreter (`DIST_CKPT_TORCHAO_PYTHON`, a venv made by .ci/run)
with this repository on PYTHONPATH; our package never imports it.
"""

from __future__ import annotations

import os

import pytest

from tests.interop import _launch

pytestmark = [pytest.mark.interop, pytest.mark.timeout(300)]
PYTHON = os.environ.get("DIST_CKPT_TORCHAO_PYTHON")


@pytest.mark.skipif(
    not _launch.probe(PYTHON, _launch.TORCHAO_PROBE),
    reason="torchao is not installed: set DIST_CKPT_TORCHAO_PYTHON to a python with torchao==0.18 (.ci/run does)",
)
def test_torchao_weights_round_trip_bitwise_and_survive_a_lost_node_and_a_damaged_replica(tmp_path):
    """Also: swizzled MX scales load only into the split that saved them, else are refused."""
    assert PYTHON is not None
    result = str(tmp_path / "res.json")
    env = {"PYTHONPATH": _launch.pythonpath(_launch.REPO)}
    _launch.run_side(
        PYTHON,
        [_launch.side_script("torchao_side.py"), str(tmp_path), result],
        timeout=240,
        env=env,
    )
    checks = _launch.read_json(result)
    names = [
        f"{w}_{c}"
        for w in ("f8", "mx")
        for c in ("same_split", "full_tensor", "node_lost", "replica_damaged")
    ]
    swizzled = [
        f"mxsw_{b}_{c}"
        for b in ("torch_dist", "fully_parallel")
        for c in ("same_split", "full_tensor_refused", "columns_refused")
    ]
    want = dict.fromkeys([*names, *swizzled, "node_lost_tier", "replica_damaged_tier"], True)
    assert checks == {"0": want, "1": want}, checks
