"""Rank functions for the sealing tests (importable by worker ranks)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def full_tensors(scale: float) -> Dict[str, torch.Tensor]:
    """The global tensors of a checkpoint: the same layout for every `scale`, other values."""
    return {
        "w": torch.arange(32, dtype=torch.float32).reshape(8, 4) * scale,
        "v": torch.arange(12, dtype=torch.float32).reshape(2, 6) * scale + 1,
    }


def save_pair(dir_a: str, dir_b: str, dir_plain: str) -> None:
    """2 ranks: checkpoints A (scale 1) and B (scale 2) of one layout (rows of `w`, columns of
    `v` split across ranks), and one saved without checksums (`dir_plain`, scale 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for ckpt, scale, checksums in ((dir_a, 1.0, True), (dir_b, 2.0, True), (dir_plain, 1.0, False)):
        full = full_tensors(scale)
        sd = {
            "w": ShardedTensor.from_rank_offsets(
                "w", full["w"].chunk(world, 0)[rank].clone(), (0, rank, world)
            ),
            "v": ShardedTensor.from_rank_offsets(
                "v", full["v"].chunk(world, 1)[rank].clone(), (1, rank, world)
            ),
            "step": int(scale),
        }
        strategy = TorchDistSaveShardedStrategy(checksums=checksums)  # (not the shared default)
        dc.save(sd, ckpt, sharded_strategy=strategy)


def load_whole(ckpt: str) -> Dict[str, object]:
    """One process: loads every tensor of a checkpoint whole (planned from the load index,
    as any `load` is) and its common state."""
    request = {
        key: ShardedTensor.from_rank_offsets(key, torch.empty_like(t))
        for key, t in full_tensors(1.0).items()
    }
    return dc.load(request, ckpt)


def load_outcome(ckpt: str) -> Tuple[str, str]:
    """Each rank loads its rows of `w` (a resharded request): `('', '')`, or the error raised
    as (class name, message)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ShardedTensor.from_rank_offsets("w", torch.empty(8 // world, 4), (0, rank, world))
    try:
        dc.load({"w": rows}, ckpt)
    except Exception as e:  # the test compares every rank's
        return type(e).__name__, str(e)
    return "", ""


def _local_state(scale: float, fill: bool = True) -> Dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    w = full_tensors(scale)["w"].chunk(world, 0)[rank].clone()
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", w if fill else torch.zeros_like(w), (0, rank, world)
        ),
        "step": int(scale),
    }


def save_local_pair(dir_a: str, dir_b: str) -> None:
    """2 ranks: ('local', 2) checkpoints A (scale 1) and B (scale 2) of one layout."""
    for ckpt, scale in ((dir_a, 1.0), (dir_b, 2.0)):
        dc.save(_local_state(scale), ckpt, sharded_strategy=("local", 2))


def load_local(ckpt: str) -> str:
    """'A' when `ckpt` loads as checkpoint A, 'B' as B, else the class of the error."""
    try:
        got = dc.load(_local_state(0.0, fill=False), ckpt)
    except dc.errors.CheckpointingException as e:
        return f"{type(e).__name__}: {e}"
    for name, scale in (("A", 1.0), ("B", 2.0)):
        if torch.equal(got["w"], _local_state(scale)["w"].data) and got["step"] == int(scale):
            return name
    return "a mix"
