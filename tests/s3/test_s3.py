"""`s3://` checkpoints against a loopback S3 server (moto): round trips on 2 gloo ranks,
reshard, async save, the manager's persistent tier, `dist-ckpt ls / inspect / verify`, and
the commit marker written last."""

from __future__ import annotations

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.errors import CheckpointingException, NotACheckpointError
from tests.s3 import _s3_fns
from tests.s3._server import env
from tests.s3.conftest import boto3, keys

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("async_save", [False, True])
def test_roundtrip_on_two_ranks_then_reshard_in_one_process(
    world_factory, bucket, s3_endpoint, async_save
):
    url = f"s3://{bucket}/run/iter_0000007"
    world = world_factory(2)
    world.run_ok(_s3_fns.save, env(s3_endpoint), url, 7, async_save)
    names = [k.rsplit("/", 1)[1] for k in keys(bucket, "run/iter_0000007/")]
    assert "metadata.json" in names and ".metadata" in names and "common.pt" in names
    assert any(n.endswith(".distcp.sums") for n in names)  # block checksums as for files
    full = torch.arange(128, dtype=torch.float32).reshape(8, 16) + 7
    for rank, (w, o, step, common) in enumerate(world.run_ok(_s3_fns.load, env(s3_endpoint), url)):
        assert torch.equal(w, full[:, rank * 8 : (rank + 1) * 8])
        assert o == {"rank": rank, "step": 7} and step == 7 and common == {"step": 7}
    # another layout: one process reads a column band across both ranks' shards
    band = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 16))}, url)["w"]
    assert torch.equal(band, full)


def test_prefix_without_marker_is_not_a_checkpoint(bucket):
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key="run/iter_0000001/.metadata", Body=b"x")
    with pytest.raises(NotACheckpointError, match="no metadata.json"):
        dc.load({}, f"s3://{bucket}/run/iter_0000001")
    assert not dc.check_is_distributed_checkpoint(f"s3://{bucket}/run/iter_0000001")


def _state(v: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), v)), "step": v}


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_retention_latest_fallback_and_resume_on_store(bucket, async_save):
    root = f"s3://{bucket}/job"
    opts = CheckpointManagerOptions(save_interval=1, keep_last=2, async_save=async_save)
    with CheckpointManager(root, opts) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(float(step)))
    assert manager.all_steps() == [2, 3]  # step 1 deleted only after 3 committed
    latest = (
        boto3.client("s3")
        .get_object(Bucket=bucket, Key="job/latest_checkpointed_iteration.txt")["Body"]
        .read()
    )
    assert latest.strip() == b"3"
    # a damaged newest checkpoint: the manager falls back to step 2, then saves on
    for name in ("__0_0.distcp", "__0_1.distcp"):  # w's file and the plain values' file
        boto3.client("s3").put_object(Bucket=bucket, Key=f"job/iter_0000003/{name}", Body=b"bad")
    manager = CheckpointManager(root, opts)
    out, step = manager.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))})
    assert step == 2 and torch.equal(out["w"], torch.full((4, 3), 2.0))
    assert not dc.check_is_distributed_checkpoint(f"{root}/iter_0000003")  # moved aside
    manager.save(4, _state(4.0))
    manager.close()
    assert manager.all_steps() == [2, 4]


def test_cli_ls_inspect_verify_on_store(bucket, capsys):
    dc.save(_state(1.0), f"s3://{bucket}/job/iter_0000001")
    boto3.client("s3").put_object(Bucket=bucket, Key="job/iter_0000002/__0_0.distcp", Body=b"x")
    assert main(["ls", f"s3://{bucket}/job"]) == 0
    out = capsys.readouterr().out
    assert "iter_0000001" in out and "complete" in out and "INCOMPLETE" in out
    assert main(["inspect", f"s3://{bucket}/job/iter_0000001"]) == 0
    assert "torch.float32" in capsys.readouterr().out
    assert main(["verify", f"s3://{bucket}/job/iter_0000001"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["inspect", f"s3://{bucket}/job/iter_0000002"]) != 0


@pytest.mark.parametrize("url", ["xyz://bucket/ckpt", "s3://"])
def test_unsupported_url_is_refused_not_made_a_local_directory(url, tmp_path):
    with pytest.raises(CheckpointingException, match="scheme|bucket"):
        dc.save(_state(1.0), url)
    with pytest.raises(CheckpointingException, match="scheme|bucket"):
        dc.load({}, url)
    assert main(["ls", url]) != 0
    assert list(tmp_path.iterdir()) == []
