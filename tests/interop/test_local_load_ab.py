"""The interleaved local-load benchmark (ours against nvidia-resiliency-ext), tiny, 2 ranks.

It runs in megatron-core 0.19's side interpreter (`DIST_CKPT_MCORE19_PYTHON`, with
nvidia-resiliency-ext 0.7.0 on `DIST_CKPT_MCORE19_PATH`), this repository on its path.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.interop import _launch

pytestmark = [pytest.mark.interop, pytest.mark.timeout(180)]
PYTHON = os.environ.get("DIST_CKPT_MCORE19_PYTHON")
NVRX_PATH = os.environ.get("DIST_CKPT_MCORE19_PATH", "")


@pytest.mark.skipif(
    not PYTHON or not NVRX_PATH,
    reason="nvidia-resiliency-ext is not set up: DIST_CKPT_MCORE19_PYTHON and "
    "DIST_CKPT_MCORE19_PATH name it (.ci/run sets them)",
)
def test_local_load_ab_times_both_libraries_loads_alternately_and_checks_them(tmp_path):
    """Both managers save the same state; every round loads each (checked bit for bit inside
    the run) and reads the part plainly; each row has one sample per round."""
    assert PYTHON is not None
    args = ["-m", "benchmarks.local_load_ab", "--world-size", "2", "--mib-per-rank", "1"]
    args += ["--rounds", "2", "--dir", str(tmp_path / "ab")]
    env = {"PYTHONPATH": os.pathsep.join([NVRX_PATH, _launch.REPO])}
    out = _launch.run_side(PYTHON, args, timeout=150, env=env)
    res = json.loads(out.strip().splitlines()[-1])
    for row in ("ours", "ours, copied", "nvrx", "read"):
        assert len(res["samples"][row]) == 2 and res[f"{row} s"] > 0, row
    assert res["ours / nvrx"] == pytest.approx(res["ours s"] / res["nvrx s"])
    assert res["ours / ours, copied"] == pytest.approx(res["ours s"] / res["ours, copied s"])
    assert not os.path.exists(tmp_path / "ab")
