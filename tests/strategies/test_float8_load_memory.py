"""Loading float8 data (a quantized weight's inner tensors) into allocated destinations needs
no memory beyond them and one read request: the stored bytes are read in place, not through
a `torch.load` of each stored chunk (a scratch copy of every chunk, twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_checkpointing.strategies.torch_dist.reader import READ_REQUEST

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).with_name("_float8_rss.py")


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_float8_weights_load_in_place_within_one_read_request(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run("save", ckpt, "6")  # 96 MiB of float8 data in 16 MiB weights
    measured = json.loads(_run("load", ckpt, "6").strip().splitlines()[-1])
    assert measured["in_place"] and measured["bit_for_bit"], measured
    assert measured["growth"] <= READ_REQUEST, measured
