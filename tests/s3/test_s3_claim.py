"""A save's claim on an `s3://` prefix: a conditional PUT (`If-None-Match: *`) that a second
save cannot repeat, checked against the loopback server (moto)."""

from __future__ import annotations

import json

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointClaimedError
from tests.s3.conftest import boto3, keys

pytestmark = pytest.mark.timeout(120)


def _state(v: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), v)), "step": v}


def test_save_claims_its_prefix_and_a_claimed_prefix_is_refused(bucket):
    url = f"s3://{bucket}/run/iter_0000001"
    dc.save(_state(1.0), url)
    assert "run/iter_0000001/claim.json" in keys(bucket, "run/")
    other = {"format": 1, "host": "elsewhere", "pid": 4242, "time": "2026-01-01T00:00:00+00:00"}
    other["token"] = "f" * 32
    boto3.client("s3").put_object(
        Bucket=bucket, Key="run/iter_0000002/claim.json", Body=json.dumps(other).encode()
    )
    with pytest.raises(CheckpointClaimedError, match="f{32}, pid 4242 on host 'elsewhere'"):
        dc.save(_state(2.0), f"s3://{bucket}/run/iter_0000002")
    assert keys(bucket, "run/iter_0000002/") == ["run/iter_0000002/claim.json"]  # nothing written
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))}, url)
    assert torch.equal(got["w"], torch.full((4, 3), 1.0))
