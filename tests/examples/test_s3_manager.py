"""examples/s3_manager.py against a loopback S3 server: two tiers, retention, resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3._server import env, start_server

boto3 = pytest.importorskip("boto3", reason="the [s3] extra (boto3) is not installed")
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).parents[2]


def test_s3_manager_example_saves_both_tiers_keeps_two_and_resumes(tmp_path):
    proc, endpoint = start_server()
    try:
        environment = {**os.environ, **env(endpoint), "PYTHONPATH": str(ROOT)}
        environment["OMP_NUM_THREADS"] = "1"
        keys = {k.lower(): v for k, v in env(endpoint).items() if "KEY" in k}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
        client.create_bucket(Bucket="example")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", str(ROOT / "examples" / "s3_manager.py")]
        cmd += [str(tmp_path / "local"), "s3://example/run"]
        outs = []
        for steps in ("8", "12"):
            out = subprocess.run(
                [*cmd, "--steps", steps],
                env=environment,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=280,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            outs.append(out.stdout)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "persistent checkpoints in s3://example/run: steps [4, 8]" in outs[0]
    assert "resumed from step 8, w = 8.0" in outs[1]
    assert "steps [8, 12]" in outs[1]
    assert sorted(os.listdir(tmp_path)) == ["local"]  # nothing else written locally
