"""Rank functions for the fully parallel wrapper tests (module-level so they can be sent)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.strategies.base import LoadShardedStrategy
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

#: replicated tensors of different sizes (rows of 16 floats), so balancing has work to do
SIZES = (40, 31, 23, 17, 11, 7, 5, 3)


def full(i: int) -> torch.Tensor:
    return torch.arange(SIZES[i] * 16, dtype=torch.float32).reshape(SIZES[i], 16) + 1000 * i


def state(load: bool, split_axis: int = 0) -> Dict[str, Any]:
    """Every rank holds every `rep.i` (replicas; rank 0's is main) and its piece of `tp`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sd: Dict[str, Any] = {}
    for i in range(len(SIZES)):
        data = torch.zeros_like(full(i)) if load else full(i).clone()
        sd[f"rep{i}"] = ShardedTensor.from_rank_offsets(f"rep{i}", data, replica_id=rank)
    tp_full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    piece = tp_full.chunk(world, dim=split_axis)[rank]
    sd["tp"] = ShardedTensor.from_rank_offsets(
        "tp", torch.zeros_like(piece) if load else piece.clone(), (split_axis, rank, world)
    )
    sd["obj"] = ShardedObject("obj", None if load else {"r": rank}, (world,), (rank,))
    sd["step"] = 4
    return sd


def check(out: Dict[str, Any], split_axis: int) -> List[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = [f"rep{i}" for i in range(len(SIZES)) if not torch.equal(out[f"rep{i}"], full(i))]
    tp_full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    if not torch.equal(out["tp"], tp_full.chunk(world, dim=split_axis)[rank]):
        bad.append("tp")
    if out["step"] != 4:
        bad.append("step")
    return bad


class CountingLoad(TorchDistLoadShardedStrategy):
    """Records the ShardedTensor shards this rank reads."""

    read: List[Tuple[str, Tuple[int, ...]]] = []

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        from dist_checkpointing.dict_utils import nested_values

        CountingLoad.read = [
            (sh.key, tuple(sh.global_offset))
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor)
        ]
        return super().load(sharded_state_dict, checkpoint_dir)


def save(ckpt: str, fully_parallel: bool, split_axis: int = 0) -> None:
    strategy: Any = TorchDistSaveShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)
    dc.save(state(load=False, split_axis=split_axis), ckpt, sharded_strategy=strategy)


def load(
    ckpt: str, fully_parallel: bool, split_axis: int, exchange_algo: str = "broadcast"
) -> Tuple[List[str], list]:
    inner: LoadShardedStrategy = CountingLoad()
    strategy: Any = (
        FullyParallelLoadStrategyWrapper(inner, exchange_algo=exchange_algo)
        if fully_parallel
        else inner
    )
    request = state(load=True, split_axis=split_axis)
    out = dc.load(request, ckpt, sharded_strategy=strategy)
    bad = check(out, split_axis)
    # in place: the request's destination tensors hold the values too
    if not torch.equal(request["rep0"].data, full(0)):
        bad.append("rep0 not loaded in place")
    if out["obj"] != {"r": dist.get_rank()}:
        bad.append("obj")
    return bad, CountingLoad.read


def exchange(in_flight_bytes: int) -> List[str]:
    """Every rank holds some shards (of different sizes) and wants all of them; the exchange
    runs with `IN_FLIGHT_BYTES` set to `in_flight_bytes` (1: a wait after every transfer).

    Returns what arrived wrong on this rank."""
    from dist_checkpointing import exchange_utils

    rank, world = dist.get_rank(), dist.get_world_size()

    def shard(i: int) -> torch.Tensor:
        return torch.arange(7 * (i + 1), dtype=torch.float32) + 100 * i

    keys = range(3 * world)
    wanted = [ShardedTensor.from_rank_offsets(f"x{i}", torch.zeros(7 * (i + 1))) for i in keys]
    tensors: Dict[Any, Any] = {
        exchange_utils.shard_id(sh): (shard(i) if i % world == rank else None)
        for i, sh in zip(keys, wanted)
    }
    saved, exchange_utils.IN_FLIGHT_BYTES = exchange_utils.IN_FLIGHT_BYTES, in_flight_bytes
    try:
        sent = exchange_utils.exchange_shards(tensors, wanted)
    finally:
        exchange_utils.IN_FLIGHT_BYTES = saved
    bad = [
        f"x{i}"
        for i, sh in zip(keys, wanted)
        if not torch.equal(tensors[exchange_utils.shard_id(sh)], shard(i))
    ]
    mine = sum(shard(i).numel() * 4 for i in keys if i % world == rank)
    if sent != mine * (world - 1):
        bad.append(f"sent {sent} bytes, expected {mine * (world - 1)}")
    return bad
