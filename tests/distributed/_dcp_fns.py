"""Rank functions of `test_dcp_interop.py`: one training-like state written and read by
stock PyTorch DCP on one side and by us on the other (2 gloo ranks)."""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedTensor

WORLD = 2
ROWS = 5  # uneven over 2 ranks: 3 + 2


def full_tensors() -> Dict[str, torch.Tensor]:
    """The global tensors, by DCP flat name."""
    return {
        "model.w": torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) / 7,
        "model.b": torch.arange(3, dtype=torch.bfloat16) - 1.5,
        "optim.state.model.w.exp_avg": torch.linspace(-1, 1, ROWS * 4).reshape(ROWS, 4),
        "optim.state.model.w.step": torch.tensor(12.0),
    }


def plain_values() -> Dict[str, Any]:
    """The non-tensor state, nested as a training loop holds it."""
    return {
        "step": 12,
        "optim": {
            "param_groups": [
                {"lr": 0.01, "betas": (0.9, 0.99), "params": ["model.w", "model.b"]},
                {"lr": 0.5, "params": ["model.c"]},
            ]
        },
        "meta": {"name": "run-1", "tags": ["a", "b"], "none": None},
    }


def _nested(tensors: Dict[str, Any]) -> Dict[str, Any]:
    """The state dict a training loop has: tensors under their paths plus plain values."""
    state = plain_values()
    state["model"] = {"w": tensors["model.w"], "b": tensors["model.b"]}
    state["optim"]["state"] = {
        "model.w": {
            "exp_avg": tensors["optim.state.model.w.exp_avg"],
            "step": tensors["optim.state.model.w.step"],
        }
    }
    return state


def save_stock(ckpt: str) -> None:
    """Stock `dcp.save` of the state: row-sharded DTensors (uneven), plain tensors, values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    full = full_tensors()
    tensors: Dict[str, Any] = dict(full)
    for key in ("model.w", "optim.state.model.w.exp_avg"):
        tensors[key] = distribute_tensor(full[key], mesh, [Shard(0)])
    dcp.save(_nested(tensors), checkpoint_id=ckpt)


def _request(rank: int, stock: bool) -> Dict[str, Any]:
    """Our request of the same state, in other shardings: `model.w` by columns, the moment
    whole on each rank (replicas), plain values at their places (`None` placeholders). The
    plain tensor `step` is requested from a stock DCP checkpoint (a tensor item there); ours
    hold it in their common state."""
    state = plain_values()
    state["step"] = None
    state["model"] = {
        "w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(ROWS, 2), (1, rank, WORLD)),
        "b": ShardedTensor.from_rank_offsets(
            "model.b", torch.zeros(3, dtype=torch.bfloat16), replica_id=rank
        ),
    }
    state["optim"]["state"] = {
        "model.w": {
            "exp_avg": ShardedTensor.from_rank_offsets(
                "optim.state.model.w.exp_avg", torch.zeros(ROWS, 4), replica_id=rank
            ),
        }
    }
    if stock:
        state["optim"]["state"]["model.w"]["step"] = ShardedTensor.from_rank_offsets(
            "optim.state.model.w.step", torch.zeros(()), replica_id=rank
        )
    return state


def load_ours(ckpt: str, stock: bool) -> Dict[str, Any]:
    """Our `load` of `ckpt` (written by `stock` DCP or by us), and what the metadata readers
    say (on every rank)."""
    rank = dist.get_rank()
    loaded = dc.load(_request(rank, stock), ckpt)
    tensors = dc.load_tensors_metadata(ckpt)
    return {
        "loaded": loaded,
        "tensors": {k: (tuple(v.global_shape), v.dtype) for k, v in tensors.items()},
        "sharded": sorted(dc.load_sharded_metadata(ckpt)),
        "common": dc.load_common_state_dict(ckpt),
        "is_checkpoint": dc.check_is_distributed_checkpoint(ckpt),
    }


def save_ours(ckpt: str, how: str) -> None:
    """Our `save` of the same state: ShardedTensors keyed by their flat names (columns split),
    the plain tensor `step` and plain values in the common state."""
    rank = dist.get_rank()
    full = full_tensors()
    tensors: Dict[str, Any] = dict(full)
    for key in ("model.w", "optim.state.model.w.exp_avg"):  # by columns: DCP reads rows
        data = full[key][:, 2 * rank : 2 * rank + 2].clone()
        tensors[key] = ShardedTensor.from_rank_offsets(key, data, (1, rank, WORLD))
    tensors["model.b"] = ShardedTensor.from_rank_offsets(
        "model.b", full["model.b"].clone(), replica_id=rank
    )
    strategy = None
    if how == "fully_parallel":
        from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
        from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    async_save = how == "async"
    request = dc.save(_nested(tensors), ckpt, strategy, async_sharded_save=async_save)
    if request is not None:
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()


def load_stock(ckpt: str) -> Dict[str, Any]:
    """Stock `dcp.load` of our checkpoint into row-sharded DTensors and emptied plain values;
    returns this rank's values (DTensors as their full tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    tensors: Dict[str, Any] = {k: torch.zeros_like(v) for k, v in full_tensors().items()}
    for key in ("model.w", "optim.state.model.w.exp_avg"):
        tensors[key] = distribute_tensor(tensors[key], mesh, [Shard(0)])
    state = _nested(tensors)
    state["step"] = 0
    # DCP finds a value by the flat name of its place in the request: same structure
    state["optim"]["param_groups"] = [{"lr": 0, "betas": 0, "params": 0}, {"lr": 0, "params": 0}]
    state["meta"] = {"name": "", "tags": 0, "none": 1}
    dcp.load(state, checkpoint_id=ckpt)

    def whole(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.full_tensor()
        if isinstance(x, dict):
            return {k: whole(v) for k, v in x.items()}
        return x

    return whole(state)


def save_colliding(ckpt: str) -> None:
    """A save whose plain value has the flat name of another rank's tensor key."""
    rank = dist.get_rank()
    state: Dict[str, Any] = {"plain": {"x": 1}}
    if rank == 1:
        state["t"] = ShardedTensor.from_rank_offsets("plain.x", torch.ones(2))
    else:
        state["t"] = ShardedTensor.from_rank_offsets("other", torch.ones(2))
    dc.save(state, ckpt, validate_access_integrity=False)
