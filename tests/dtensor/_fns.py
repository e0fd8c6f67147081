"""Rank functions of the DTensor / FSDP2 tests (run on every rank of a gloo world)."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

import dist_checkpointing as dc
from dist_checkpointing import _dist
from dist_checkpointing._fqn import fqn_of, iter_fqn_leaves

CHECKS = ("same", "async", "fully_parallel", "local", "manager")


def _mesh(shape: Sequence[int], names: Optional[Tuple[str, ...]] = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def make_model(mesh: Any, seed: int, tp: bool = False) -> Tuple[nn.Module, Any]:
    """Two linears (the second with 5 output rows: uneven shards) under `fully_shard`, and
    Adam; with `tp`, tensor parallel on the mesh's "tp" dimension under FSDP on "dp"."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 5))
    dp = mesh
    if tp:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        dp = mesh["dp"]
    for layer in model:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: Any) -> None:
    torch.manual_seed(1234)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def full_values(state: Dict[str, Any]) -> Dict[str, Any]:
    """Every leaf by flat name, DTensors gathered whole (collective), tensors as CPU copies."""
    from torch.distributed.tensor import DTensor

    out = {}
    for path, leaf in iter_fqn_leaves(state):
        if isinstance(leaf, DTensor):
            leaf = leaf.full_tensor()
        out[fqn_of(path)] = leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
    return out


def same_values(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Flat names whose values differ (tensors bit for bit)."""
    bad = sorted(a.keys() ^ b.keys())
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            ok = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            ok = ok and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        else:
            ok = x == y
        if not ok:
            bad.append(k)
    return bad


def _state(model: nn.Module, optim: Any) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def save_trained(mesh_shape: Sequence[int], ckpt: str, tp: bool = False) -> Dict[str, Any]:
    """Trains one step on a mesh of `mesh_shape`, saves `get_state_dict`'s output; returns
    the whole values (for the loading side to compare with)."""
    names = ("dp", "tp") if tp else (("replicate", "shard") if len(mesh_shape) == 2 else None)
    model, optim = make_model(_mesh(mesh_shape, names), seed=0, tp=tp)
    train_step(model, optim)
    state = _state(model, optim)
    dc.save(state, ckpt)
    return full_values(state)


def load_into(mesh_shape: Sequence[int], ckpt: str, tp: bool = False) -> Dict[str, Any]:
    """Loads `ckpt` into a fresh model and Adam on a mesh of `mesh_shape` (through
    `set_state_dict`); returns the whole values the model and optimizer then hold."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.tensor import DTensor

    names = ("dp", "tp") if tp else (("replicate", "shard") if len(mesh_shape) == 2 else None)
    model, optim = make_model(_mesh(mesh_shape, names), seed=7, tp=tp)
    request = _state(model, optim)
    placements = {
        fqn_of(p): (v.placements, v.device_mesh)
        for p, v in iter_fqn_leaves(request)
        if isinstance(v, DTensor)
    }
    loaded = dc.load(request, ckpt)
    for p, v in iter_fqn_leaves(loaded):  # DTensors come back as requested
        if fqn_of(p) in placements:
            assert isinstance(v, DTensor), fqn_of(p)
            assert (v.placements, v.device_mesh) == placements[fqn_of(p)], fqn_of(p)
    set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return full_values(_state(model, optim))


def save_and_load_same(ckpt: str) -> Tuple[List[str], int]:
    """The values that differ after a save and load at the same mesh, and how many
    `all_gather_object` calls the save made (ranks holding equal plain tensors, Adam's
    `step`, need no comparison of their common state)."""
    gathers = 0
    stock = dist.all_gather_object

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal gathers
        gathers += 1
        return stock(*args, **kwargs)

    dist.all_gather_object = counted
    try:
        want = save_trained((dist.get_world_size(),), ckpt)
    finally:
        dist.all_gather_object = stock
    return same_values(want, load_into((dist.get_world_size(),), ckpt)), gathers


def wrappers(root: str) -> Dict[str, List[str]]:
    """Saves and loads the FSDP2 state through async save, the fully parallel wrappers, the
    ('local', 2) backend and the CheckpointManager; returns the differing names of each."""
    from dist_checkpointing.manager import CheckpointManager
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    out: Dict[str, List[str]] = {}
    model, optim = make_model(_mesh((world,)), seed=0)
    train_step(model, optim)
    want = full_values(_state(model, optim))

    def check(name: str, save: Any, load: Any) -> None:
        ckpt = os.path.join(root, name)
        save(_state(model, optim), ckpt)
        fresh, fresh_optim = make_model(_mesh((world,)), seed=7)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        loaded = load(_state(fresh, fresh_optim), ckpt)
        set_state_dict(
            fresh, fresh_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        out[name] = same_values(want, full_values(_state(fresh, fresh_optim)))

    def async_save(state: Any, ckpt: str) -> None:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(dc.save(state, ckpt, async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()

    check("async", async_save, dc.load)
    fp_save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))
    fp_load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    check(
        "fully_parallel",
        lambda s, c: dc.save(s, c, fp_save),
        lambda s, c: dc.load(s, c, fp_load),
    )
    node = os.path.join(root, f"node{rank}")
    check(
        "local",
        lambda s, c: dc.save(s, os.path.join(node, "l"), ("local", 2)),
        lambda s, c: dc.load(s, os.path.join(node, "l")),
    )
    manager = CheckpointManager(os.path.join(root, "managed"))
    check(
        "manager",
        lambda s, c: manager.save(3, s, force=True),
        lambda s, c: manager.load(s)[0],
    )
    manager.close()
    return out


def refusal(case: str, root: str) -> Tuple[str, float]:
    """A save that must be refused on every rank within seconds; returns the error text
    and how long it took (or 'saved')."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    _dist.set_collective_timeout(20)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh((world,))
    if case == "subclass":

        class Odd(torch.Tensor):
            pass

        state: Any = {"odd": torch.ones(2).as_subclass(Odd)}
    elif case == "per_rank_tensor":
        state = {"step": torch.tensor(float(rank))}
    elif case == "partial":
        state = {"p": DTensor.from_local(torch.ones(2), mesh, [Partial()])}
    elif case == "tuple":
        state = {"t": (DTensor.from_local(torch.ones(2), mesh, [Replicate()]),)}
    else:
        raise ValueError(case)
    start = time.monotonic()
    try:
        dc.save(state, os.path.join(root, case))
    except dc.CheckpointingException as e:
        return str(e), time.monotonic() - start
    finally:
        _dist.set_collective_timeout(600)
    return "saved", time.monotonic() - start


def rep_of(full: torch.Tensor, mesh: Any) -> Any:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)


class AppState:
    """The DCP tutorial's `Stateful` wrapper of a model and its optimizer."""

    def __init__(self, model: nn.Module, optim: Any) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> Dict[str, Any]:
        return _state(self.model, self.optim)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def stateful_lists_and_plain(root: str) -> Dict[str, Any]:
    """A Stateful object, DTensors inside a list, plain tensors filled in place, a missing
    plain value named, an unplaceable leaf in a load request refused; returns what each gave."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    out: Dict[str, Any] = {}
    model, optim = make_model(_mesh((world,)), seed=0)
    train_step(model, optim)
    want = full_values(_state(model, optim))
    dc.save({"app": AppState(model, optim)}, os.path.join(root, "app"))
    fresh = AppState(*make_model(_mesh((world,)), seed=7))
    loaded = dc.load({"app": fresh}, os.path.join(root, "app"))
    out["stateful_returned"] = loaded["app"] is fresh
    out["stateful"] = same_values(want, full_values(_state(fresh.model, fresh.optim)))

    mesh = _mesh((world,))
    full = torch.arange(10.0).reshape(5, 2)
    items = [distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None), rep_of(full, mesh)]
    rep = DTensor.from_local(full.clone(), mesh, [Replicate()])
    ckpt = os.path.join(root, "lists")
    dc.save({"items": items, "rep": rep, "step": torch.tensor(3.0)}, ckpt)
    req_items = [torch.zeros_like(items[0]), torch.zeros_like(items[1])]
    step = torch.tensor(0.0)
    got = dc.load({"items": req_items, "step": step}, ckpt)
    out["list"] = all(
        got["items"][i] is req_items[i] and torch.equal(got["items"][i].full_tensor(), full)
        for i in (0, 1)
    )
    out["plain_in_place"] = got["step"] is step and step.item() == 3.0
    try:
        dc.load({"items": req_items, "lr": torch.zeros(1)}, ckpt)
        out["missing"] = "loaded"
    except dc.CheckpointingException as e:
        out["missing"] = str(e)

    # a plain tensor in the checkpoint loads into a DTensor request
    dc.save({"plain": full.clone()}, os.path.join(root, "plain"))
    request = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)], src_data_rank=None)
    got = dc.load({"plain": request}, os.path.join(root, "plain"))["plain"]
    out["plain_into_dtensor"] = got is request and torch.equal(request.full_tensor(), full)
    try:
        dc.save({"mixed": [rep, torch.ones(1)]}, os.path.join(root, "mixed"))
        out["mixed"] = "saved"
    except dc.CheckpointingException as e:
        out["mixed"] = str(e)

    class Odd(torch.Tensor):
        pass

    try:
        _dist.set_collective_timeout(20)
        dc.load({"rep": rep, "odd": torch.ones(1).as_subclass(Odd)}, ckpt)
        out["odd_request"] = "loaded"
    except dc.CheckpointingException as e:
        out["odd_request"] = str(e)
    finally:
        _dist.set_collective_timeout(600)
    return out
