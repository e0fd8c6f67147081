"""The tools name what they cannot read: a valid checkpoint of a backend they do not read, or
a local tier of a user's `TensorAwareStateDict`, is named with what reads it (never called
damaged or unusable), and each verb's refusal names that verb and what it found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_checkpointing.cli import main
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager


@pytest.fixture
def custom(tmp_path) -> Path:
    """A committed checkpoint of a user's backend ('my_backend', 3): its own files."""
    ckpt = tmp_path / "custom"
    ckpt.mkdir()
    config = {"sharded_backend": "my_backend", "sharded_backend_version": 3}
    (ckpt / "metadata.json").write_text(json.dumps({**config, "common_backend": "torch"}))
    torch.save({"step": 1}, ckpt / "common.pt")
    (ckpt / "shards.bin").write_bytes(b"\0" * 64)
    return ckpt


@pytest.fixture
def basic_tier(tmp_path) -> Path:
    """A LocalCheckpointManager's tier holding a BasicTensorAwareStateDict (one process)."""
    manager = LocalCheckpointManager(tmp_path / "local", session_id="run")
    manager.save(BasicTensorAwareStateDict({"t": torch.arange(3.0), "it": 5}), 5)
    return tmp_path / "local" / "run"


def _out(capsys, argv, code: int) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_a_custom_backend_checkpoint_is_named_with_what_reads_it(custom, capsys):
    for argv in (["ls", str(custom.parent)], ["inspect", str(custom)]):
        out = _out(capsys, argv, 0)
        assert "my_backend" in out and "register_default_strategy" in out, out
        assert "UNUSABLE" not in out and "DAMAGED" not in out, out
    out = _out(capsys, ["verify", str(custom)], 2)
    assert "dist-ckpt verify:" in out and "'my_backend' v3" in out and "DAMAGED" not in out, out


def test_a_local_tier_of_a_users_state_class_is_listed_and_verified(basic_tier, capsys):
    out = _out(capsys, ["inspect", str(basic_tier)], 0)
    assert "BasicTensorAwareStateDict" in out and "LocalCheckpointManager.load" in out, out
    assert "(3,)" in out  # its tensor, with the rank's own shape
    assert "OK" in _out(capsys, ["verify", str(basic_tier)], 0)


@pytest.mark.parametrize("verb", ["convert", "diff"])
def test_convert_and_diff_refusals_name_their_own_verb(custom, basic_tier, tmp_path, verb, capsys):
    def args(path: Path) -> list:
        extra = [str(tmp_path / "out.pt"), "--to", "torch"] if verb == "convert" else [str(path)]
        return [verb, str(path), *extra]

    out = _out(capsys, args(custom), 2)
    assert f"dist-ckpt {verb}:" in out and f"{verb} reads torch_dist" in out, out
    assert "'my_backend' v3" in out
    out = _out(capsys, args(basic_tier), 2)
    assert f"{verb} reads torch_dist" in out and "local tier" in out, out
    other = "diff" if verb == "convert" else "convert"
    assert f"{other} reads" not in out
