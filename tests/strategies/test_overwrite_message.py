"""Saving over a complete checkpoint is refused with a message that says what to do."""

from __future__ import annotations

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointExistsError


def test_save_over_a_complete_checkpoint_says_what_to_do(tmp_path):
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    dc.save(state, tmp_path / "iter_0000100")
    with pytest.raises(CheckpointExistsError) as info:
        dc.save(state, tmp_path / "iter_0000100")
    message = str(info.value)
    assert "refusing to overwrite it" in message
    assert "Save to a new directory" in message and "remove this one first" in message
