"""Planning cost: 8 ranks, 1,000 small tensors each, first save against repeated saves.

Each of the 1,000 global tensors (256 x 64 fp32) is split on rows over the ranks. Saves
go to tmpfs (/dev/shm) so that the figures show coordination, not the disk. For each save:
the whole `save` (max over ranks), the sharding validation exchange, and the finalization
(rank 0 builds DCP's metadata and writes `.metadata` and `checksums.json`). Repeated saves
of an unchanged structure skip the metadata exchange and reuse rank 0's metadata.

    python -m benchmarks.bench_planning --world-size 8 --tensors 1000 --saves 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from benchmarks._common import init_world, max_over_ranks, print_table, run_world


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    import dist_checkpointing.serialization as ser
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    spent: Dict[str, float] = {}

    def timed_method(owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    timed_method(ser, "_validate_save_sharding", "validation exchange")
    timed_method(TorchDistSaveShardedStrategy, "_finalize", "finalize")
    rows = 256 // world
    sd = {
        f"layer{i}.w": ShardedTensor.from_rank_offsets(
            f"layer{i}.w", torch.randn(rows, 64), (0, rank, world)
        )
        for i in range(args.tensors)
    }
    out: List[Dict[str, Any]] = []
    for step in range(args.saves):
        spent.clear()
        dist.barrier()
        t0 = time.perf_counter()
        dc.save(sd, os.path.join(args.dir, f"s{step}"))
        total = max_over_ranks(time.perf_counter() - t0)
        out.append(
            {
                "save": "first" if step == 0 else f"repeat {step}",
                "save s": total,
                "validation exchange s": max_over_ranks(spent.get("validation exchange", 0.0)),
                "finalize s": max_over_ranks(spent.get("finalize", 0.0)),
            }
        )
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dir", default="/dev/shm/dist_ckpt_bench_planning")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = run_world(_worker, args.world_size, args)
    shutil.rmtree(args.dir, ignore_errors=True)
    print_table(
        f"{args.world_size} ranks x {args.tensors} tensors (256x64 fp32 each, split on rows), max over ranks",
        rows,
        list(rows[0]),
    )


if __name__ == "__main__":
    main()
