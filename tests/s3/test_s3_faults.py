"""Faults on the way to the store: throttling and server errors (retried, then a clear
error), a connection reset mid-upload, a missing bucket and wrong credentials (named on
every rank, nothing complete-looking left), a rank killed mid-upload, and the per-rank
memory bound of uploads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.errors import CheckpointingException
from tests._world import get_world
from tests.s3 import _s3_fns
from tests.s3._server import FaultProxy, Rule, env
from tests.s3.conftest import keys

pytestmark = pytest.mark.timeout(180)


def _state(n: int = 3 << 20) -> dict:  # 12 MiB: a multipart upload of 3 parts of 5 MiB
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(n, dtype=torch.float32))}


@pytest.fixture
def proxy(s3_endpoint, bucket, monkeypatch):
    """A fault proxy in front of the server; this process talks to the store through it."""
    p = FaultProxy(s3_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setenv("DIST_CKPT_S3_PART_MB", "5")
    yield p
    p.close()


def _loads(url: str) -> bool:
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3 << 20))}
    return torch.equal(dc.load(request, url)["w"], _state()["w"].data)


@pytest.mark.parametrize(
    "rule",
    [
        Rule("uploadId", 503, "SlowDown", times=2),  # two parts throttled
        Rule("PUT", 500, "InternalError", times=2),
        Rule("partNumber=2", 0, times=1),  # connection reset mid-body
        Rule("GET", 503, "SlowDown", times=2),  # reads retried too
    ],
    ids=["slowdown", "500", "reset", "read-503"],
)
def test_transient_faults_are_retried(proxy, bucket, rule):
    proxy.rules.append(rule)
    url = f"s3://{bucket}/c"
    dc.save(_state(), url)
    assert _loads(url) and rule.hits == rule.times


def test_persistent_fault_fails_clearly_and_leaves_no_marker(proxy, bucket, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    proxy.rules.append(Rule("partNumber=2", 503, "SlowDown", times=100))
    url = f"s3://{bucket}/c"
    with pytest.raises(
        CheckpointingException, match=f"s3://{bucket}/c/__0_0.distcp at {proxy.endpoint}.*SlowDown"
    ):
        dc.save(_state(), url)
    assert "c/metadata.json" not in keys(bucket) and not dc.check_is_distributed_checkpoint(url)
    proxy.rules.clear()
    dc.save(_state(), url)  # the next save succeeds
    assert _loads(url)


@pytest.mark.parametrize("fault", ["missing bucket", "wrong credentials"])
def test_access_errors_name_bucket_and_endpoint_on_every_rank(world_factory, proxy, bucket, fault):
    environment = {**env(proxy.endpoint), "AWS_MAX_ATTEMPTS": "2"}
    name = bucket
    if fault == "missing bucket":
        name = "no-such-bucket"
    else:  # moto accepts any key pair: the proxy answers as S3 does to a key it never issued
        environment["AWS_ACCESS_KEY_ID"] = "AKIAWRONGWRONGWRONG0"
        proxy.rules.append(Rule("AKIAWRONGWRONG", 403, "InvalidAccessKeyId", times=10**6))
    messages = world_factory(2).run_ok(_s3_fns.save_expecting_error, environment, f"s3://{name}/c")
    for m in messages:
        assert m and name in m and proxy.endpoint in m, messages
    assert keys(bucket) == []


def test_upload_memory_stays_within_two_parts_per_request(bucket, tmp_path):
    """64 MiB through 5 MiB parts, 2 requests at a time: the rank's added peak (tracemalloc,
    after a warm-up save that pools the staging chunk buffers) stays within the documented
    bound, 2 x part x concurrency = 20 MiB of part buffers, plus under 1 MiB of requests and
    plans (a copy of the file would be 64 MiB)."""
    script = textwrap.dedent(f"""
        import os, tracemalloc, torch
        os.environ.update(DIST_CKPT_S3_PART_MB="5", DIST_CKPT_S3_CONCURRENCY="2")
        import dist_checkpointing as dc
        sd = {{"w": dc.ShardedTensor.from_rank_offsets("w", torch.ones(16 << 20))}}
        dc.save(sd, "s3://{bucket}/warm")
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        dc.save(sd, "s3://{bucket}/measured")
        print(tracemalloc.get_traced_memory()[1] - base)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) <= 2 * (5 << 20) * 2 + (1 << 20), out.stdout


def test_rank_killed_mid_upload_leaves_no_checkpoint_and_the_next_save_works(
    s3_endpoint, bucket, capsys
):
    """Rank 1 is SIGKILLed (by the proxy, when a part of its data object arrives):
    no marker, `dist-ckpt ls` shows the prefix incomplete, load refuses it, the previous
    checkpoint loads and the next save succeeds."""
    world = get_world(2)
    proxy = FaultProxy(s3_endpoint)
    victim = world.procs[1].pid
    match = "iter_0000002/__1_0.distcp?uploadId"  # a part of rank 1's data object
    kill = Rule(match, 0, action=lambda: os.kill(victim, signal.SIGKILL))
    proxy.rules.append(kill)
    environment = {**env(proxy.endpoint), "DIST_CKPT_S3_PART_MB": "5"}
    root = f"s3://{bucket}/run"
    try:
        world.run_ok(_s3_fns.save_big, environment, f"{root}/iter_0000001", 1)
        outcomes = get_world(2).run_tolerating_deaths(
            _s3_fns.save_big, environment, f"{root}/iter_0000002", 2, timeout=120
        )
    finally:
        proxy.close()
    assert kill.hits == 1 and outcomes[1] is None, outcomes
    assert outcomes[0] is not None and outcomes[0].unwrap(), "the survivor must raise, not hang"
    assert "run/iter_0000002/metadata.json" not in keys(bucket, "run/iter_0000002/")
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out.splitlines()
    listing = {line.rsplit("/", 1)[-1]: line for line in out if "iter_" in line}
    assert "INCOMPLETE" in listing["iter_0000002"], out
    assert " complete" in listing["iter_0000001"], out
    not_ckpt, error, a_ok, c_ok = get_world(2).run_ok(
        _s3_fns.after_kill, env(s3_endpoint), root, timeout=120
    )[0]
    assert not_ckpt and error == "NotACheckpointError" and a_ok and c_ok
