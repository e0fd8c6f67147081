"""Writes a flattened-range checkpoint with megatron-core 0.13.1 (interop tests only).

Usage: python mcore013_side.py CKPT_DIR

Run with an interpreter that has megatron-core 0.13.1 installed; never imported by our
package or by the test process. Two gloo ranks save distributed-optimizer style state built
with megatron's own `ShardedTensor.from_rank_offsets_flat` (what megatron-core <= 0.13
writes for its distributed optimizer): flat ranges that cross row boundaries, split
unevenly between ranks, on a grid split along either axis, with prepended axes.
"""

from __future__ import annotations

import os
import sys


def expected():
    """The global tensors (also used by the test process to check what it loads)."""
    import torch

    return {
        "opt.a": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),
        "opt.b": (torch.arange(4 * 10, dtype=torch.float32) * -1.5).reshape(4, 10),
        "opt.c": torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16),
    }


def worker(rank: int, world: int, port: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    # megatron-core calls these even for CPU tensors
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor

    g = expected()
    a_ranges = [(0, 20), (20, 48)]  # one grid piece, split unevenly across the two ranks
    lo, hi = a_ranges[rank]
    c_ranges = [(0, 7), (7, 12)]  # each layer's piece split across the two ranks
    clo, chi = c_ranges[rank]
    sd = {
        "a": ShardedTensor.from_rank_offsets_flat(
            "opt.a", g["opt.a"].flatten()[lo:hi].clone(), (8, 6), flattened_range=slice(lo, hi)
        ),
        # grid split on columns: rank r holds column block r whole, as a flat range
        "b": ShardedTensor.from_rank_offsets_flat(
            "opt.b",
            g["opt.b"][:, rank * 5 : (rank + 1) * 5].flatten().clone(),
            (4, 5),
            (1, rank, world),
            flattened_range=slice(0, 20),
        ),
        "c": [
            ShardedTensor.from_rank_offsets_flat(
                "opt.c",
                g["opt.c"][layer].flatten()[clo:chi].clone(),
                (3, 4),
                (0, layer, 2),
                prepend_axis_num=1,
                flattened_range=slice(clo, chi),
            )
            for layer in range(2)
        ],
        "iteration": 7,
    }
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    mdc.save(sd, ckpt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _side_spawn import spawn_two

    spawn_two(worker, sys.argv[1])
