"""FSDP2 on CUDA (one GPU, NCCL): the DTensor state dict's round trip through our save and
load (sync and async, `set_state_dict` after it) and stock `dcp.load` of what we wrote."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp2_state_dict_on_cuda_round_trips_bitwise_sync_async_and_through_stock_dcp(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "_fsdp2_cuda.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
