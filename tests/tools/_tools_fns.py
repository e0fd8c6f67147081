"""Rank functions and checkpoint builders for the tools tests (importable by worker ranks)."""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor


def full_tensors() -> Dict[str, torch.Tensor]:
    """The global tensors every multi-rank checkpoint of these tests holds."""
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(8, 6, generator=g),
        "cols": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "layers": torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4),
        "norm": torch.randn(6, generator=g).to(torch.float16),
        "ids": torch.arange(6, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
    }


def save_sharded(ckpt: str, backend: str = "torch_dist") -> None:
    """2 ranks: row and column splits, a prepended axis, replicated tensors, objects, common."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = full_tensors()
    sd = {
        "rows": ShardedTensor.from_rank_offsets(
            "rows", full["rows"].chunk(world, 0)[rank].clone(), (0, rank, world)
        ),
        "cols": ShardedTensor.from_rank_offsets(
            "cols", full["cols"].chunk(world, 1)[rank].clone(), (1, rank, world)
        ),
        "layers": ShardedTensor.from_rank_offsets(
            "layers", full["layers"][rank].clone(), (0, rank, world), prepend_axis_num=1
        ),
        "norm": ShardedTensor.from_rank_offsets("norm", full["norm"].clone(), replica_id=rank),
        "ids": ShardedTensor.from_rank_offsets("ids", full["ids"].clone(), replica_id=rank),
        "flag": ShardedTensor.from_rank_offsets("flag", full["flag"].clone(), replica_id=rank),
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
        "iteration": 7,
        "args": {"lr": 0.5, "name": "run" * 40},
    }
    dc.save(sd, ckpt, sharded_strategy=(backend, 2 if backend == "local" else 1))


def save_stock_dcp(ckpt: str) -> None:
    """Stock PyTorch DCP (no metadata.json): the full tensors, as DCP's own planner shards them."""
    import torch.distributed.checkpoint as dcp

    full = full_tensors()
    dcp.save({**full, "step": 3}, checkpoint_id=ckpt)


def save_big(ckpt: str, n: int, rows: int, cols: int) -> None:
    """2 ranks: n float32 tensors of rows x cols, split by columns (non-contiguous pieces)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {}
    for i in range(n):
        full = torch.full((rows, cols), float(i)) + torch.arange(cols, dtype=torch.float32)
        sd[f"t{i:02d}"] = ShardedTensor.from_rank_offsets(
            f"t{i:02d}", full.chunk(world, 1)[rank].clone(), (1, rank, world)
        )
    dc.save(sd, ckpt)


def save_with_manager(base: str) -> None:
    """2 ranks, a CheckpointManager with both tiers: persistent step 4, local steps 3 and 6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    options = dc.CheckpointManagerOptions(
        save_interval=4, async_save=False, local_root=f"{base}/local", local_save_interval=3
    )
    manager = dc.CheckpointManager(f"{base}/persistent", options)
    rows = full_tensors()["rows"].chunk(world, 0)[rank].clone()
    for step in range(1, 7):
        manager.save(
            step, {"rows": ShardedTensor.from_rank_offsets("rows", rows, (0, rank, world))}
        )
    manager.close()


def quantized_weights() -> Dict[str, Any]:
    """The global quantized weights of `save_quantized`: per-row float8_e4m3fn 'w', MX-like
    'mx' (float8_e8m0fnu scales per 1x32) and 'sw', MX-like with swizzled scales."""
    from tests import _quant

    return {
        "w": _quant.quantize("row", torch.float8_e4m3fn),
        "mx": _quant.quantize("mx", torch.float8_e5m2),
        "sw": _quant.quantize("mx", torch.float8_e4m3fn),
    }


def save_quantized(ckpt: str, changed_scale: bool = False) -> None:
    """2 ranks, row-split quantized weights (`quantized_weights`) and a plain float8 tensor;
    with `changed_scale`, rank 1's first scale of 'w' is doubled (one value differs)."""
    from tests import _quant

    rank, world = dist.get_rank(), dist.get_world_size()
    sd: Dict[str, Any] = {}
    for key, q in quantized_weights().items():
        kind = "row" if key == "w" else "mx"
        mine = _quant.piece(q, kind, 0, rank, world)
        if key == "sw":
            mine = _quant.swizzle(mine)
        if key == "w" and changed_scale and rank == 1:
            mine.scale = mine.scale.clone()
            mine.scale[0] *= 2
        sd[key] = ShardedTensor.from_rank_offsets(key, mine, (0, rank, world))
    plain = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.float8_e5m2)
    sd["plain"] = ShardedTensor.from_rank_offsets("plain", plain, replica_id=rank)
    dc.save(sd, ckpt)
