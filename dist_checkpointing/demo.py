"""The demo behind `dist-ckpt demo`: save with one sharding, load with another, verify.

It spawns a gloo world of N CPU processes, builds a small transformer-like sharded state
(tensor-parallel weights split on rows or columns, replicated layer norms, a per-rank
ShardedObject and common state), saves it, loads it back with every split axis swapped,
checks every byte, and prints a table.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DemoConfig", "run_demo"]


@dataclass
class DemoConfig:
    """Shape of the demo state and where to put it.

    Attributes:
        world_size: number of processes.
        hidden: model width.
        layers: number of transformer layers.
        vocab: embedding rows.
        directory: parent of the checkpoint directory (a temp dir when empty).
    """

    world_size: int = 4
    hidden: int = 512
    layers: int = 4
    vocab: int = 8192
    directory: str = ""


def _global_tensor(name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % (2**31)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _specs(cfg: DemoConfig) -> List[Tuple[str, Tuple[int, ...], torch.dtype, int]]:
    """(key, global shape, dtype, tensor-parallel axis or -1 for replicated)."""
    h = cfg.hidden
    specs: List[Tuple[str, Tuple[int, ...], torch.dtype, int]] = [
        ("embedding.weight", (cfg.vocab, h), torch.bfloat16, 0)
    ]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        specs += [
            (p + "attn.qkv.weight", (3 * h, h), torch.bfloat16, 0),
            (p + "attn.proj.weight", (h, h), torch.bfloat16, 1),
            (p + "mlp.fc1.weight", (4 * h, h), torch.bfloat16, 0),
            (p + "mlp.fc2.weight", (h, 4 * h), torch.bfloat16, 1),
            (p + "norm.weight", (h,), torch.float32, -1),
        ]
    return specs


def _state(cfg: DemoConfig, swap_axes: bool, with_data: bool) -> Dict[str, Any]:
    from .mapping import ShardedObject, ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    sd: Dict[str, Any] = {}
    for key, shape, dtype, axis in _specs(cfg):
        if axis < 0:
            local = (
                _global_tensor(key, shape, dtype) if with_data else torch.empty(shape, dtype=dtype)
            )
            sd[key] = ShardedTensor.from_rank_offsets(key, local, replica_id=rank)
            continue
        if swap_axes and len(shape) == 2:
            axis = 1 - axis
        size = shape[axis] // world
        if with_data:
            local = _global_tensor(key, shape, dtype).narrow(axis, rank * size, size).clone()
        else:
            local = torch.empty(
                *(size if a == axis else s for a, s in enumerate(shape)), dtype=dtype
            )
        sd[key] = ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))
    sd["rng"] = ShardedObject(
        "rng_state", {"rank": rank, "seed": 1234 + rank} if with_data else None, (world,), (rank,)
    )
    sd["iteration"] = 100
    return sd


def _worker(rank: int, cfg: DemoConfig, rendezvous: str, ckpt: str, log_level: int) -> None:
    from . import serialization
    from .mapping import ShardedTensor

    # one intra-op thread per rank, as torchrun sets for several processes per node
    # (OMP_NUM_THREADS=1): with torch's default (a thread per core in every rank), 4 ranks
    # on 2 cores spun against each other in the load's copies, which took 0.42-0.68 s
    # instead of 0.14 s on our CI VM
    torch.set_num_threads(1)
    # spawned processes start with logging unconfigured: use the launcher's level
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(minutes=5),
    )
    try:
        # importing torch.distributed.checkpoint costs seconds once per process; keep it out of the timings
        serialization.get_default_save_sharded_strategy()
        state = _state(cfg, swap_axes=False, with_data=True)
        nbytes = sum(
            math.prod(v.local_shape) * v.dtype.itemsize
            for v in state.values()
            if isinstance(v, ShardedTensor) and v.replica_id == 0
        )
        dist.barrier()
        t0 = time.perf_counter()
        serialization.save(state, ckpt)
        save_s = time.perf_counter() - t0
        request = _state(cfg, swap_axes=True, with_data=False)
        dist.barrier()
        t0 = time.perf_counter()
        loaded = serialization.load(request, ckpt)
        load_s = time.perf_counter() - t0
        assert isinstance(loaded, dict)
        mismatches = []
        for key, value in request.items():
            if isinstance(value, ShardedTensor):
                want = _global_tensor(key, value.global_shape, value.dtype)[value.global_slice()]
                if not torch.equal(
                    loaded[key].view(torch.uint8), want.contiguous().view(torch.uint8)
                ):
                    mismatches.append(key)
        if loaded["rng"] != {"rank": rank, "seed": 1234 + rank} or loaded["iteration"] != 100:
            mismatches.append("rng/iteration")
        totals = torch.tensor([nbytes, len(mismatches)], dtype=torch.float64)
        dist.all_reduce(totals)
        times = torch.tensor([save_s, load_s], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            _print_report(
                cfg,
                ckpt,
                len(_specs(cfg)),
                int(totals[0]),
                float(times[0]),
                float(times[1]),
                int(totals[1]),
            )
        if totals[1]:
            raise SystemExit(f"rank {rank}: mismatched {mismatches}")
    finally:
        dist.destroy_process_group()


def _print_report(
    cfg: DemoConfig, ckpt: str, n: int, nbytes: int, save_s: float, load_s: float, bad: int
) -> None:
    files = sorted(os.listdir(ckpt))
    print(f"dist_checkpointing demo: {cfg.world_size} ranks (gloo), checkpoint {ckpt}")
    print(
        "  saved with tensor-parallel splits on the usual axes; loaded with every split axis swapped"
    )
    print(f"  files: {', '.join(files)}")
    print()
    print(
        f"  {'tensors':>8} {'bytes':>12} {'save s':>8} {'save GB/s':>10} {'load s':>8} {'load GB/s':>10}"
    )
    print(
        f"  {n:>8} {nbytes:>12,} {save_s:>8.3f} {nbytes / save_s / 1e9:>10.3f} {load_s:>8.3f} {nbytes / load_s / 1e9:>10.3f}"
    )
    print()
    print(
        "  verified: every byte of every resharded tensor, the ShardedObjects and the common state"
        if not bad
        else f"  FAILED: {bad} mismatches"
    )


def run_demo(cfg: DemoConfig) -> None:
    """Runs the demo in a fresh gloo world of `cfg.world_size` processes.

    Raises:
        ValueError: when the world size does not divide the model dimensions.
    """
    if cfg.world_size < 1 or any(
        s[a] % cfg.world_size for _, s, _, a in _specs(cfg) for a in range(len(s))
    ):
        raise ValueError(
            f"world size {cfg.world_size} must divide hidden={cfg.hidden} and vocab={cfg.vocab}"
        )
    parent = cfg.directory or tempfile.mkdtemp(prefix="dist_ckpt_demo_")
    ckpt = os.path.join(parent, f"iter_{int(time.time())}")
    # a file rendezvous: no free-port race with other processes on the machine
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_demo_rdzv_") as rdzv:
        mp.spawn(
            _worker,
            args=(cfg, os.path.join(rdzv, "store"), ckpt, logging.getLogger().getEffectiveLevel()),
            nprocs=cfg.world_size,
            join=True,
        )
