"""`msc://profile/path` checkpoints: the real multi-storage-client reads a config written
here (pointed at by `MSC_CONFIG`) and the loopback S3 server holds the objects. The AWS
environment of these tests points at a dead endpoint, so only the profile's settings reach
the store."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.errors import CheckpointingException
from tests.s3 import _s3_fns
from tests.s3._server import CREDENTIALS, FaultProxy, Rule, env
from tests.s3.conftest import boto3

pytest.importorskip("multistorageclient", reason="multi-storage-client is not installed")
pytestmark = pytest.mark.timeout(180)

DEAD = "http://127.0.0.1:9"  # nothing listens: a request through the AWS environment fails


def _config(endpoint: str, bucket: str) -> str:
    return textwrap.dedent(f"""
        profiles:
          ckpt:
            storage_provider:
              type: s3
              options:
                base_path: {bucket}/base
                endpoint_url: {endpoint}
                region_name: us-east-1
            credentials_provider:
              type: S3Credentials
              options:
                access_key: ${{MSC_TEST_KEY}}
                secret_key: test
          nobucket:
            storage_provider:
              type: s3
              options:
                base_path: no-such-bucket
                endpoint_url: {endpoint}
          gcs:
            storage_provider:
              type: gcs
              options:
                base_path: {bucket}
        """)


@pytest.fixture
def msc_env(s3_endpoint, bucket, tmp_path, monkeypatch):
    """The environment of a job whose MSC config names the loopback server (profile `ckpt`:
    the bucket's prefix `base/`) while its AWS environment names a dead endpoint."""
    path = tmp_path / "msc_config.yaml"
    path.write_text(_config(s3_endpoint, bucket))
    environment = {
        **env(DEAD),
        "AWS_MAX_ATTEMPTS": "1",
        "MSC_CONFIG": str(path),
        "MSC_TEST_KEY": "test",
    }
    for k, v in environment.items():
        monkeypatch.setenv(k, v)
    return environment


def _store(endpoint: str):
    keys = {k.lower(): v for k, v in CREDENTIALS.items()}
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)


def _keys(endpoint: str, bucket: str, prefix: str) -> list:
    r = _store(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


def _state(v: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), v)), "step": v}


@pytest.mark.parametrize("async_save", [False, True])
def test_msc_roundtrip_on_two_ranks_loads_the_same_through_the_s3_url(
    world_factory, msc_env, s3_endpoint, bucket, async_save
):
    world = world_factory(2)
    world.run_ok(_s3_fns.save, msc_env, "msc://ckpt/run/iter_0000007", 7, async_save)
    names = [k.rsplit("/", 1)[1] for k in _keys(s3_endpoint, bucket, "base/run/iter_0000007/")]
    assert "metadata.json" in names and ".metadata" in names and "common.pt" in names
    via_msc = world.run_ok(_s3_fns.load, msc_env, "msc://ckpt/run/iter_0000007")
    s3_env = {**env(s3_endpoint), "MSC_CONFIG": msc_env["MSC_CONFIG"]}
    via_s3 = world.run_ok(_s3_fns.load, s3_env, f"s3://{bucket}/base/run/iter_0000007")
    full = torch.arange(128, dtype=torch.float32).reshape(8, 16) + 7
    for rank, ((w, o, step, common), (w3, o3, step3, common3)) in enumerate(zip(via_msc, via_s3)):
        assert torch.equal(w, full[:, rank * 8 : (rank + 1) * 8])
        assert torch.equal(w.view(torch.int32), w3.view(torch.int32))  # bit for bit
        assert o == o3 == {"rank": rank, "step": 7} and step == step3 == 7
        assert common == common3 == {"step": 7}


def test_manager_persistent_tier_on_msc(msc_env, s3_endpoint, bucket):
    root = "msc://ckpt/job"
    opts = CheckpointManagerOptions(save_interval=1, keep_last=2)
    with CheckpointManager(root, opts) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(float(step)))
    assert manager.all_steps() == [2, 3]
    got = _store(s3_endpoint).get_object(
        Bucket=bucket, Key="base/job/latest_checkpointed_iteration.txt"
    )
    assert got["Body"].read().strip() == b"3"
    manager = CheckpointManager(root, opts)
    out, step = manager.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))})
    manager.close()
    assert step == 3 and torch.equal(out["w"], torch.full((4, 3), 3.0))


def test_cli_ls_inspect_verify_on_msc(msc_env, capsys):
    dc.save(_state(1.0), "msc://ckpt/job/iter_0000001")
    assert main(["ls", "msc://ckpt/job"]) == 0
    out = capsys.readouterr().out
    assert "iter_0000001" in out and "complete" in out
    assert main(["inspect", "msc://ckpt/job/iter_0000001"]) == 0
    assert "torch.float32" in capsys.readouterr().out
    assert main(["verify", "msc://ckpt/job/iter_0000001"]) == 0
    assert "OK" in capsys.readouterr().out
    common = dc.load_common_state_dict("msc://ckpt/job/iter_0000001")
    assert common == {"step": 1.0}


@pytest.mark.parametrize(
    "url, match",
    [
        ("msc://gcs/ckpt", r"msc://gcs/ckpt: MSC profile 'gcs': storage provider 'gcs'"),
        (
            "msc://absent/ckpt",
            r"msc://absent/ckpt: MSC profile 'absent': not found in .*msc_config",
        ),
    ],
)
def test_profile_not_served_is_refused_naming_it(msc_env, url, match, capsys):
    with pytest.raises(CheckpointingException, match=match):
        dc.save(_state(1.0), url)
    with pytest.raises(CheckpointingException, match=match):
        dc.load({}, url)
    assert main(["ls", url]) != 0
    assert "MSC profile" in capsys.readouterr().err


def test_store_errors_name_the_msc_path_and_the_bucket_behind_it(msc_env, s3_endpoint):
    with pytest.raises(CheckpointingException) as e:
        dc.save(_state(1.0), "msc://nobucket/run/a")
    assert "msc://nobucket/run/a" in str(e.value) and "no-such-bucket" in str(e.value)
    assert s3_endpoint in str(e.value)


def test_profile_credentials_are_used_not_the_aws_environment(
    msc_env, s3_endpoint, bucket, monkeypatch, tmp_path
):
    """The proxy refuses the AWS environment's key, as S3 does a key it never issued."""
    proxy = FaultProxy(s3_endpoint)
    try:
        proxy.rules.append(Rule("AKIAENVIRONMENTKEY00", 403, "InvalidAccessKeyId", times=10**6))
        config = tmp_path / "proxied.yaml"
        config.write_text(_config(proxy.endpoint, bucket))
        monkeypatch.setenv("MSC_CONFIG", str(config))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENVIRONMENTKEY00")
        monkeypatch.setenv("MSC_TEST_KEY", "AKIAPROFILEKEY000000")
        dc.save(_state(2.0), "msc://ckpt/creds")
        got = dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))}, "msc://ckpt/creds"
        )
    finally:
        proxy.close()
    assert torch.equal(got["w"], torch.full((4, 3), 2.0))
    assert proxy.seen and all("AKIAPROFILEKEY000000" in r for r in proxy.seen)


def test_msc_path_without_the_package_is_refused_naming_it(msc_env, tmp_path):
    """A process where `import multistorageclient` fails, as where it is not installed."""
    script = textwrap.dedent("""
        import sys
        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "multistorageclient":
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, Missing())
        import torch
        import dist_checkpointing as dc
        from dist_checkpointing.errors import CheckpointingException
        sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.ones(4))}
        for call in (lambda: dc.save(sd, "msc://ckpt/x"), lambda: dc.load(sd, "msc://ckpt/x")):
            try:
                call()
            except CheckpointingException as e:
                print("refused:", e)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line in lines:
        assert "msc://ckpt/x: msc:// paths need pip install 'dist_checkpointing[msc]'" in line
        assert "multi-storage-client" in line
    assert list(tmp_path.iterdir()) == [tmp_path / "msc_config.yaml"]
