"""metadata.json: the commit marker, parsed strictly and written atomically."""

from __future__ import annotations

import json
import os

import pytest

from dist_checkpointing.core import (
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    maybe_load_config,
    save_config,
)
from dist_checkpointing.errors import CheckpointCorruptedError


def test_config_round_trip_and_format(tmp_path):
    save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), tmp_path)
    assert json.loads((tmp_path / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert maybe_load_config(tmp_path) == CheckpointingConfig("torch_dist")
    assert check_is_distributed_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["metadata.json"]  # no temp file left


def test_missing_config_means_not_a_checkpoint(tmp_path):
    assert maybe_load_config(tmp_path) is None
    assert not check_is_distributed_checkpoint(tmp_path)
    assert not check_is_distributed_checkpoint(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    assert not check_is_distributed_checkpoint(tmp_path / "file")


def test_megatron_style_config_without_common_fields_loads(tmp_path):
    (tmp_path / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "extra": 5}'
    )
    assert maybe_load_config(tmp_path) == CheckpointingConfig("torch_dist", 1, "torch", 1)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[]",
        b'{"sharded_backend_version": 1}',
        b'{"sharded_backend": 3}',
        b'{"sharded_backend": "x", "sharded_backend_version": "1"}',
        b"\xff\xfe",
    ],
)
def test_invalid_config_is_corrupted_not_a_checkpoint(tmp_path, content):
    (tmp_path / "metadata.json").write_bytes(content)
    with pytest.raises(CheckpointCorruptedError, match="metadata.json"):
        maybe_load_config(tmp_path)
    assert not check_is_distributed_checkpoint(tmp_path)


def test_failed_config_write_leaves_old_file(tmp_path, monkeypatch):
    save_config(CheckpointingConfig("a"), tmp_path)

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save_config(CheckpointingConfig("b"), tmp_path)
    assert maybe_load_config(tmp_path).sharded_backend == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json"]
