"""examples/hf_model_fsdp2.py runs as shown: a megatron-core GPT checkpoint into an FSDP2
transformers model, one AdamW step, and back (needs an interpreter with `transformers`:
this one, else `DIST_CKPT_MCORE_PYTHON`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interop import _launch

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).parents[2]
_ENV = {"PYTHONPATH": _launch.pythonpath(str(ROOT)), "OMP_NUM_THREADS": "1"}
PYTHON = sys.executable if importlib.util.find_spec("transformers") else None
if PYTHON is None and _launch.importable(os.environ.get("DIST_CKPT_MCORE_PYTHON"), "transformers"):
    PYTHON = os.environ["DIST_CKPT_MCORE_PYTHON"]


@pytest.mark.skipif(
    PYTHON is None, reason="needs transformers here or in DIST_CKPT_MCORE_PYTHON (.ci/run)"
)
def test_hf_model_example_loads_trains_one_step_and_saves_back(tmp_path):
    assert PYTHON is not None
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "hf_model_fsdp2.py"), str(tmp_path)]
    out = subprocess.run(
        cmd, env={**os.environ, **_ENV}, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank}: megatron checkpoint into the FSDP2 model, same logits: OK" in out.stdout
        )
        assert f"rank {rank}: saved to megatron's layout and loaded back: OK" in out.stdout
