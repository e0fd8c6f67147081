"""The `dist-ckpt` command: demo (a small world) and inspect."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor


@pytest.mark.timeout(180)
def test_demo_saves_reshards_verifies_and_reports(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dist_checkpointing",
        "demo",
        "--world-size",
        "2",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--vocab",
        "256",
        "--dir",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verified: every byte" in out.stdout and "save GB/s" in out.stdout
    (ckpt,) = list(tmp_path.iterdir())
    assert dc.check_is_distributed_checkpoint(ckpt)


def test_inspect_lists_tensors_objects_and_common_keys(tmp_path, capsys):
    from dist_checkpointing.cli import main

    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3)),
            "o": ShardedObject("rng", 1, (1,), (0,)),
            "step": 4,
        },
        tmp_path / "c",
    )
    assert main(["inspect", str(tmp_path / "c")]) == 0
    text = capsys.readouterr().out
    assert (
        "torch_dist v1" in text
        and "(2, 3)" in text
        and "rng/shard_0_1" in text
        and "value   step" in text
    )
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a checkpoint but a directory of 1 checkpoint(s)" in capsys.readouterr().err
