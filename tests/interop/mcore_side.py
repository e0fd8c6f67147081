"""Runs megatron-core's dist_checkpointing in a 2-rank gloo world (interop tests only).

Usage: python mcore_side.py MODE CKPT_DIR RESULT_JSON [MODE CKPT_DIR RESULT_JSON ...]
with MODE one of save, load, save-f8, load-f8

Run with an interpreter that has megatron-core 0.16.1 installed. Never imported by our
package; the test process imports only `expected` and `float8_tensors`. `save` writes a
checkpoint with megatron-core; `load` loads one (written by us) with a different sharding and
records what it found. `save-f8` / `load-f8`: the same with `float8_tensors`, row-split on
save, column-split on load, compared bit for bit. Several jobs run in order in one world
(one interpreter start and one world instead of one per job), each writing its own
RESULT_JSON.
"""

from __future__ import annotations

import json
import os
import sys


def expected():
    import torch

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    stack = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    return full, stack


def float8_tensors():
    """8x32 tensors of float8_e4m3fn, float8_e5m2 and float8_e8m0fnu, each holding every byte
    value once (NaN and infinity bit patterns included), in a different order per dtype."""
    import torch

    bits = torch.arange(256, dtype=torch.uint8)
    return {
        "e4m3": bits.reshape(8, 32).view(torch.float8_e4m3fn),
        "e5m2": bits.flip(0).reshape(8, 32).view(torch.float8_e5m2),
        "e8m0": bits.roll(101).reshape(8, 32).view(torch.float8_e8m0fnu),
    }


def _float8(mode: str, rank: int, world: int, ckpt: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor

    tensors = float8_tensors()
    if mode == "save-f8":
        rows = 8 // world
        sd = {
            k: ShardedTensor.from_rank_offsets(
                k, t[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)
            )
            for k, t in tensors.items()
        }
        if rank == 0:
            os.makedirs(ckpt, exist_ok=True)
        dist.barrier()
        mdc.save(sd, ckpt)
        dist.barrier()
        return {"saved": True}
    cols = 32 // world
    sd = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(8, cols, dtype=t.dtype), (1, rank, world))
        for k, t in tensors.items()
    }
    out = mdc.load(sd, ckpt)
    want = {k: t[:, rank * cols : (rank + 1) * cols].contiguous() for k, t in tensors.items()}
    return {
        k: out[k].dtype == want[k].dtype
        and bool(torch.equal(out[k].view(torch.uint8), want[k].view(torch.uint8)))
        for k in want
    }


def worker(rank: int, world: int, port: int, jobs: list) -> None:
    """Runs every (mode, ckpt, result) job of `jobs` in order on this rank."""
    import torch
    import torch.distributed as dist

    # megatron-core 0.16 calls these even when every tensor is on the CPU; without CUDA they raise
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    for mode, ckpt, result in jobs:
        ok = _job(mode, rank, world, ckpt)
        with open(f"{result}.{rank}", "w") as f:
            json.dump(ok, f)
        dist.barrier()
    dist.destroy_process_group()


def _job(mode: str, rank: int, world: int, ckpt: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full, stack = expected()
    if mode.endswith("-f8"):
        return _float8(mode, rank, world, ckpt)
    if mode == "save":
        sd = {
            "w": ShardedTensor.from_rank_offsets(
                "w", full[rank * 4 : (rank + 1) * 4].clone(), (0, rank, world)
            ),
            "layers": ShardedTensor.from_rank_offsets(
                "layers", stack[rank].clone(), (0, rank, world), prepend_axis_num=1
            ),
            "obj": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
            "iteration": 5,
        }
        if rank == 0:
            os.makedirs(ckpt, exist_ok=True)
        dist.barrier()
        mdc.save(sd, ckpt)
        dist.barrier()
        return {"saved": True}
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, rank, world)),
        "layers": ShardedTensor.from_rank_offsets(
            "layers",
            torch.zeros(3, 4, dtype=torch.bfloat16),
            (0, rank, world),
            prepend_axis_num=1,
        ),
        "obj": ShardedObject("rng", None, (world,), (rank,)),
    }
    out = mdc.load(sd, ckpt)
    return {
        "w": bool(torch.equal(out["w"], full[:, rank * 3 : (rank + 1) * 3])),
        "layers": bool(torch.equal(out["layers"], stack[rank])),
        "obj": out["obj"] == {"seed": rank},
        "iteration": out.get("iteration") == 5,
    }


if __name__ == "__main__":
    from _side_spawn import merge_results, spawn_two

    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, __doc__
    jobs = [tuple(args[i : i + 3]) for i in range(0, len(args), 3)]
    spawn_two(worker, jobs)
    for _, _, result in jobs:
        merge_results(result)
