"""`dist-ckpt demo`: N gloo CPU processes save a small transformer-like sharded state
(tensor-parallel weights, replicated norms, a per-rank ShardedObject, common state), load it
with every split axis swapped, check every byte and print a table.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DemoConfig", "run_demo"]
_Spec = Tuple[str, Tuple[int, ...], torch.dtype, int]  # key, global shape, dtype, TP axis or -1


@dataclass
class DemoConfig:
    """Shape of the demo state and where to put it.

    Attributes:
        world_size: number of processes.
        hidden, layers, vocab: model width, transformer layers, embedding rows.
        directory: parent of the checkpoint, kept (default: a temporary one).
        keep: keep the temporary directory.
    """

    world_size: int = 4
    hidden: int = 512
    layers: int = 4
    vocab: int = 8192
    directory: str = ""
    keep: bool = False


def _global_tensor(name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % (2**31)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _specs(cfg: DemoConfig) -> List[_Spec]:
    h = cfg.hidden
    specs: List[_Spec] = [("embedding.weight", (cfg.vocab, h), torch.bfloat16, 0)]
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


def _state(cfg: DemoConfig, swap_axes: bool, with_data: bool, step: int) -> Dict[str, Any]:
    from .mapping import ShardedObject, ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    sd: Dict[str, Any] = {}
    for key, shape, dtype, axis in _specs(cfg):
        full = _global_tensor(key, shape, dtype) if with_data else torch.empty(shape, dtype=dtype)
        if axis < 0:
            sd[key] = ShardedTensor.from_rank_offsets(key, full, replica_id=rank)
            continue
        if swap_axes and len(shape) == 2:
            axis = 1 - axis
        size = shape[axis] // world
        local = full.narrow(axis, rank * size, size).clone()
        sd[key] = ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))
    sd["rng"] = ShardedObject(
        "rng_state", {"rank": rank, "seed": 1234 + rank} if with_data else None, (world,), (rank,)
    )
    sd["iteration"] = step
    return sd


def _worker(rank: int, cfg: DemoConfig, rendezvous: str, ckpt: str, log_level: int) -> None:
    from . import serialization
    from .mapping import ShardedTensor

    torch.set_num_threads(1)  # as torchrun: else the ranks' threads spin against each other
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
        # importing torch.distributed.checkpoint is slow: keep it out of the timings
        serialization.get_default_save_sharded_strategy()
        step = int(os.path.basename(ckpt)[len("iter_") :])
        state = _state(cfg, swap_axes=False, with_data=True, step=step)
        mine = [v for v in state.values() if isinstance(v, ShardedTensor) and v.replica_id == 0]
        nbytes = sum(math.prod(v.local_shape) * v.dtype.itemsize for v in mine)
        dist.barrier()
        t0 = time.perf_counter()
        serialization.save(state, ckpt)
        save_s = time.perf_counter() - t0
        request = _state(cfg, swap_axes=True, with_data=False, step=step)
        dist.barrier()
        t0 = time.perf_counter()
        loaded = serialization.load(request, ckpt)
        load_s = time.perf_counter() - t0
        assert isinstance(loaded, dict)
        mismatches = []
        for key, value in request.items():
            if isinstance(value, ShardedTensor):
                want = _global_tensor(key, value.global_shape, value.dtype)[value.global_slice()]
                got = loaded[key].view(torch.uint8)
                if not torch.equal(got, want.contiguous().view(torch.uint8)):
                    mismatches.append(key)
        if loaded["rng"] != {"rank": rank, "seed": 1234 + rank} or loaded["iteration"] != step:
            mismatches.append("rng/iteration")
        totals = torch.tensor([nbytes, len(mismatches)], dtype=torch.float64)
        dist.all_reduce(totals)
        times = torch.tensor([save_s, load_s], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            nbytes, bad = int(totals[0]), int(totals[1])
            _print_report(cfg, ckpt, nbytes, float(times[0]), float(times[1]), bad)
        if totals[1]:
            raise SystemExit(f"rank {rank}: mismatched {mismatches}")
    finally:
        dist.destroy_process_group()


def _print_report(
    cfg: DemoConfig, ckpt: str, nbytes: int, save_s: float, load_s: float, bad: int
) -> None:
    n, save_rate, load_rate = len(_specs(cfg)), nbytes / save_s / 1e9, nbytes / load_s / 1e9
    head = ("tensors", "bytes", "save s", "save GB/s", "load s", "load GB/s")
    print(f"dist_checkpointing demo: {cfg.world_size} ranks (gloo), checkpoint {ckpt}")
    print(
        "  saved with tensor-parallel splits on the usual axes; loaded with every split axis swapped"
    )
    print(f"  files: {', '.join(sorted(os.listdir(ckpt)))}\n")
    print("  {:>8} {:>12} {:>8} {:>10} {:>8} {:>10}".format(*head))
    print(
        f"  {n:>8} {nbytes:>12,} {save_s:>8.3f} {save_rate:>10.3f} {load_s:>8.3f} {load_rate:>10.3f}\n"
    )
    verified = "every byte of every resharded tensor, the ShardedObjects and the common state"
    print(f"  FAILED: {bad} mismatches" if bad else f"  verified: {verified}")


def run_demo(cfg: DemoConfig) -> None:
    """Runs the demo in a fresh gloo world of `cfg.world_size` processes.

    Raises:
        ValueError: the world size does not divide the model dimensions.
    """
    dims = [n for _, shape, _, _ in _specs(cfg) for n in shape]
    if cfg.world_size < 1 or any(n % cfg.world_size for n in dims):
        raise ValueError(
            f"world size {cfg.world_size} must divide hidden={cfg.hidden} and vocab={cfg.vocab}"
        )
    keep = cfg.keep or bool(cfg.directory)
    parent = cfg.directory or tempfile.mkdtemp(prefix="dist_ckpt_demo_")
    os.makedirs(parent, exist_ok=True)
    done = [int(n[5:]) for n in os.listdir(parent) if re.fullmatch(r"iter_\d{7,}", n)]
    ckpt = os.path.join(parent, f"iter_{max(done, default=0) + 100:07d}")  # as a training job
    # a file rendezvous: no free-port race with other processes on the machine
    try:
        with tempfile.TemporaryDirectory(prefix="dist_ckpt_demo_rdzv_") as rdzv:
            level = logging.getLogger().getEffectiveLevel()
            args = (cfg, os.path.join(rdzv, "store"), ckpt, level)
            mp.spawn(_worker, args=args, nprocs=cfg.world_size, join=True)
    finally:
        if not keep:
            shutil.rmtree(parent, ignore_errors=True)
    print(
        f"  kept: {ckpt}" if keep else f"  removed {parent} (temporary; --keep or --dir keeps it)"
    )
