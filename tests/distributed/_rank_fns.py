"""Functions run on every rank of a test world (module-level so they can be sent)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedTensor
from tests._sharding import Box, Case, bitwise_equal, make_global


def rank() -> int:
    return dist.get_rank()


def shard_of(case: Case, box: Box, global_tensor: Optional[torch.Tensor]) -> ShardedTensor:
    offset, size, replica = box[:3]
    flat = box[3] if len(box) > 3 else None
    local_shape = size[case.prepend_axis_num :]
    if global_tensor is None:
        data = (
            torch.full(local_shape, 0, dtype=case.dtype)
            if case.dtype != torch.bool
            else torch.zeros(local_shape, dtype=torch.bool)
        )
    else:
        index = tuple(slice(o, o + s) for o, s in zip(offset, size))
        data = global_tensor[index].clone().reshape(local_shape)
    if flat is not None:  # a flat shard: that range of the flattened box
        data = data.flatten()[flat[0] : flat[1]].clone()
    return ShardedTensor(
        case.key,
        data,
        case.dtype,
        local_shape,
        case.global_shape,
        offset,
        None,
        replica,
        case.prepend_axis_num,
        False,
        slice(*flat) if flat is not None else None,
    )


def state_for(cases: List[Case], which: str, with_data: bool) -> Dict[str, Any]:
    r = rank()
    sd: Dict[str, Any] = {}
    for i, case in enumerate(cases):
        g = make_global(case) if with_data else None
        boxes = getattr(case, which)[r]
        sd[f"case{i}"] = [shard_of(case, b, g) for b in boxes]
    return sd


def save_cases(cases: List[Case], root: str) -> None:
    """Saves every case with its `save` sharding into one checkpoint under `root`."""
    dc.save(
        {**state_for(cases, "save", True), "common": {"n": len(cases)}}, os.path.join(root, "ckpt")
    )


def check_load_cases(cases: List[Case], root: str) -> List[str]:
    """Loads every case with its `load` sharding and compares bitwise with the global tensor.

    Returns a list of problems (empty on success).
    """
    ckpt = os.path.join(root, "ckpt")
    loaded = dc.load(state_for(cases, "load", False), ckpt)
    problems = []
    if loaded.get("common") != {"n": len(cases)}:
        problems.append(f"common state {loaded.get('common')!r}")
    r = rank()
    for i, case in enumerate(cases):
        g = make_global(case)
        for box, got in zip(case.load[r], loaded.get(f"case{i}", []), strict=True):
            offset, size = box[:2]
            want = g[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(
                size[case.prepend_axis_num :]
            )
            if len(box) > 3:
                want = want.flatten()[box[3][0] : box[3][1]]
            if not bitwise_equal(got, want):
                problems.append(f"rank {r} case {i} box {box}: loaded data differs")
    meta = dc.load_sharded_metadata(ckpt)
    tmeta = dc.load_tensors_metadata(ckpt)
    for case in cases:
        for md in (meta, tmeta):
            sh = md.get(case.key)
            if sh is None or sh.global_shape != case.global_shape or sh.dtype != case.dtype:
                problems.append(f"metadata of {case.key}: {sh}")
    return problems


def roundtrip_cases(cases: List[Case], root: str) -> List[str]:
    """`save_cases` then `check_load_cases` in the same world."""
    save_cases(cases, root)
    return check_load_cases(cases, root)


def call_save(
    builder: Callable[[], Dict[str, Any]], ckpt: str, kwargs: Optional[Dict[str, Any]] = None
) -> None:
    """dc.save(builder(), ckpt, **kwargs) on this rank."""
    dc.save(builder(), ckpt, **(kwargs or {}))


def call_load(
    builder: Callable[[], Dict[str, Any]], ckpt: str, kwargs: Optional[Dict[str, Any]] = None
) -> Any:
    """dc.load(builder(), ckpt, **kwargs) on this rank."""
    return dc.load(builder(), ckpt, **(kwargs or {}))


def load_called_differently_on_rank1(
    builder: Callable[[], Dict[str, Any]], ckpt: str, how: str
) -> Any:
    """dc.load(builder(), ckpt) with rank 1 called otherwise: `how` is "strategy" (a fully
    parallel wrapper) or "validate" (validate_access_integrity=False)."""
    from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy

    kwargs: Dict[str, Any] = {}
    if dist.get_rank() == 1 and how == "strategy":
        kwargs["sharded_strategy"] = FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy()
        )
    if dist.get_rank() == 1 and how == "validate":
        kwargs["validate_access_integrity"] = False
    return dc.load(builder(), ckpt, **kwargs)


def save_validating_on_rank0_only(builder: Callable[[], Dict[str, Any]], ckpt: str) -> Any:
    """dc.save(builder() with a per-rank plain value, ckpt), validating on rank 0 only;
    returns (the error's message or None, whether `ckpt` is a checkpoint afterwards)."""
    state = dict(builder(), note=f"rank {dist.get_rank()}")
    message = None
    try:
        dc.save(state, ckpt, validate_access_integrity=dist.get_rank() == 0)
    except Exception as e:
        message = f"{type(e).__name__}: {e}"
    dist.barrier()
    return message, dc.check_is_distributed_checkpoint(ckpt)


def agreement_on_this_rank(records_by_rank: List[list], repeat: int = 1) -> Any:
    """Runs the save's agreement protocol `repeat` times on this rank (gloo); returns the
    agreements, or the message of the error it raised."""
    from dist_checkpointing._sharding_agreement import AgreementCache, agreement_protocol
    from dist_checkpointing.coordination import run

    cache = AgreementCache()
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        return [
            run(agreement_protocol(me, world, records_by_rank[me], cache)) for _ in range(repeat)
        ]
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def saves_with_one_rank_changed(root: str) -> List[str]:
    """Saves 4 checkpoints of 2 tensors through the same default strategy (its caches warm),
    changing one rank's shard between some of them (a moved split point, swapped halves),
    then loads each whole and returns what differs from what was saved."""
    me, world = dist.get_rank(), dist.get_world_size()
    rows = 4 * world
    full = {
        k: torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6) + i * 1000
        for i, k in enumerate("ab")
    }
    # per save: each rank's (start, stop) rows of "a"; "b" keeps an even split throughout
    even = [(4 * r, 4 * r + 4) for r in range(world)]
    moved = [(0, 5), (5, 8)] + even[2:]
    swapped = [(4, 8), (0, 4)] + even[2:]
    layouts = [even, even, moved, swapped]
    for step, layout in enumerate(layouts):
        r0, r1 = layout[me]
        sd = {
            "a": ShardedTensor(
                "a", full["a"][r0:r1].clone(), torch.float32, (r1 - r0, 6), (rows, 6), (r0, 0), None
            ),
            "b": ShardedTensor.from_rank_offsets(
                "b", full["b"][4 * me : 4 * me + 4].clone(), (0, me, world)
            ),
        }
        dc.save(sd, os.path.join(root, f"s{step}"))
    problems = []
    for step in range(len(layouts)):
        got = dc.load(
            {
                k: ShardedTensor.from_rank_offsets(k, torch.zeros(rows, 6), replica_id=me)
                for k in "ab"
            },
            os.path.join(root, f"s{step}"),
        )
        for k in "ab":
            if not torch.equal(got[k], full[k]):
                problems.append(f"rank {me}: save {step} key {k} differs")
    return problems


def grid_tensor(key: str, k: int, tp: int, t: int) -> torch.Tensor:
    """Rows `4 t .. 4 t + 3` of `key`'s (4 tp, 8 (k + 1)) global tensor, as `grid_state` saves."""
    cols = 8 * (k + 1)
    return torch.arange(4 * tp * cols, dtype=torch.float32).reshape(4 * tp, cols)[4 * t : 4 * t + 4]


def grid_state(tp: int, keys: int) -> Dict[str, Any]:
    """This rank's ShardedTensors of `tests.unit.test_sharding_agreement.grid_records`'s
    layout, with data: row blocks over `tp` ranks, replicated over world // tp."""
    t, d = dist.get_rank() % tp, dist.get_rank() // tp
    return {
        f"layer{k}.weight": ShardedTensor.from_rank_offsets(
            f"layer{k}.weight", grid_tensor(f"layer{k}.weight", k, tp, t), (0, t, tp), replica_id=d
        )
        for k in range(keys)
    }


def fully_parallel_grid_save(root: str, tp: int, keys: int) -> Dict[Any, int]:
    """Saves `grid_state` with the fully parallel wrapper over all ranks; returns which rank
    the real distribution chose to write each of this rank's shards."""
    from dist_checkpointing.exchange_utils import compute_distribution
    from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from dist_checkpointing.strategies.torch_dist import TorchDistSaveShardedStrategy

    state = grid_state(tp, keys)
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    dc.save(state, root, sharded_strategy=strategy)
    return compute_distribution(grid_state(tp, keys), None, True).saver
