"""Fixtures of the object-store tests: one loopback S3 server per session, a bucket per test."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.s3._server import env, start_server

boto3 = pytest.importorskip("boto3", reason="the [s3] extra (boto3) is not installed")


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint of a `moto_server` on 127.0.0.1, stopped after the session."""
    proc, endpoint = start_server()
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A fresh bucket; this process's AWS environment points at the loopback server."""
    for k, v in env(s3_endpoint).items():
        monkeypatch.setenv(k, v)
    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def keys(bucket: str, prefix: str = "") -> list:
    """Every key in `bucket` under `prefix`."""
    r = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


@pytest.fixture(autouse=True)
def _no_local_scheme_dirs(tmp_path, monkeypatch):
    """Runs each test in its own directory and fails if an `s3:` directory appeared there."""
    monkeypatch.chdir(tmp_path)
    yield
    assert not [n for n in os.listdir(tmp_path) if n.endswith(":")], os.listdir(tmp_path)
