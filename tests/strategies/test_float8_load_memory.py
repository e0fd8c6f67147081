"""Loading float8 data (a quantized weight's inner tensors) into allocated destinations needs
no memory beyond them and one read request: the stored bytes are read in place, not through
a `torch.load` of each stored chunk (a scratch copy of every chunk, twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_checkpointing.strategies.torch_dist.reader import READ_REQUEST
from tests._rss import run_script

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).with_name("_float8_rss.py")


def test_float8_weights_load_in_place_within_one_read_request(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_script(SCRIPT, "save", ckpt, "6")  # 96 MiB of float8 data in 16 MiB weights
    measured = json.loads(run_script(SCRIPT, "load", ckpt, "6").strip().splitlines()[-1])
    assert measured["in_place"] and measured["bit_for_bit"], measured
    assert measured["growth"] <= READ_REQUEST, measured
