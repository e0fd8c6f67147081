"""lm-resiliency's side driver of `bench_local`'s parity phase, at a tiny size, 2 ranks.

lm-resiliency runs in its own interpreter (`DIST_CKPT_LMRES_PYTHON`, a venv made by .ci/run);
neither our package nor this test imports it.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.interop import _launch

pytestmark = [pytest.mark.interop, pytest.mark.timeout(180)]
PYTHON = os.environ.get("DIST_CKPT_LMRES_PYTHON")
SIDE = os.path.join(_launch.REPO, "benchmarks", "lmres_side.py")


@pytest.mark.skipif(
    not _launch.probe(PYTHON, _launch.LMRES_PROBE),
    reason="lm-resiliency is not installed: set DIST_CKPT_LMRES_PYTHON to a python with "
    "lm-resiliency==0.2.0 (.ci/run does)",
)
def test_lmres_side_measures_its_saves_and_recovers_a_lost_rank_bit_for_bit(tmp_path):
    """Its captures, the restart flush, the copy to the lost rank's replacement and the
    restarted job's loads run, every load checked against the saved bytes and step."""
    assert PYTHON is not None
    args = ["--world-size", "2", "--mib-per-rank", "1", "--repeats", "1"]
    out = _launch.run_side(PYTHON, [SIDE, *args, "--dir", str(tmp_path / "lmres")], timeout=150)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["lmres verified"] is True, res
    for key in (
        "lmres save blocks s",
        "lmres replicated s",
        "lmres memory rollback s",
        "lmres flush s",
        "lmres copy to replacement s",
        "lmres restart load s",
    ):
        assert len(res["lmres samples"][key]) == 1 and res[key] > 0, key
    # 2 own + 2 peer slots in host memory; own and peer files of 2 steps after the flush
    assert res["lmres host RAM kept / state"] >= 3.5, res
    assert 3.9 <= res["lmres disk after flush / state"] < 4.5, res
    assert not os.path.exists(tmp_path / "lmres")
