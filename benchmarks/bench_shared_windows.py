"""Shared-read window geometries compared in one world: column loads, alternating A/B.

A column-resharded load reads each stored chunk once per node through the reader's
shared-memory windows (`strategies/torch_dist/shared_read.py`). Three settings shape it:
the bytes per window (the library's own choice, `window_for`, depends on the ranks of the
node), `SLOTS` (windows per segment) and `AHEAD` (windows read ahead into staging
buffers). Each configuration is written `WINDOW_MiB:SLOTS:AHEAD`, `WINDOW_MiB` being
`auto` for the library's choice, with an optional `:private` (huge pages withheld: the
read-ahead uses ordinary private pages).

Every rank of one world saves 1 GiB (by default) of row blocks once, then loads column
blocks with every configuration in turn, the order rotated every round and the page cache
dropped before each load (needs root; otherwise the loads are warm and the figures say
little). The constants are module globals read at call time, so setting them on every rank
between loads changes nothing else. Prints, per configuration, the median wall time of
`barrier; load; barrier` and every sample.

    python -m benchmarks.bench_shared_windows --world 4 --mib 1024 --rounds 10 \\
        --configs auto:2:4 4:2:4 8:2:4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks import bench_disk as bd
from benchmarks._common import drop_page_cache, init_world, run_world


def _apply(config: str, real_staging: Any, real_window_for: Any) -> None:
    from dist_checkpointing.storage import buffers
    from dist_checkpointing.strategies.torch_dist import shared_read as sr

    parts = config.split(":")
    try:
        window = None if parts[0] == "auto" else int(parts[0]) << 20
        slots, ahead = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        slots = ahead = 0
    if slots < 2 or ahead < 1 or parts[3:] not in ([], ["private"]):
        raise SystemExit(
            f"bad configuration {config!r}: WINDOW_MiB|auto:SLOTS>=2:AHEAD>=1[:private]"
        )
    sr.window_for = real_window_for if window is None else (lambda node_ranks: window)
    sr.SLOTS, sr.AHEAD = slots, ahead
    buffers.staging = real_staging if not parts[3:] else (lambda nbytes: None)


def _worker(
    rank: int, world: int, root: str, mib: int, rounds: int, configs: List[str], port: int, queue
) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing.storage import buffers
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from dist_checkpointing.strategies.torch_dist import shared_read

    real_staging, real_window_for = buffers.staging, shared_read.window_for
    path = os.path.join(root, "bench_shared_windows")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    shapes = bd._shapes(mib << 20, world)
    dc.save(bd._ours_sd(shapes, "rows", True), path)
    times: Dict[str, List[float]] = {c: [] for c in configs}
    for turn in range(rounds):
        k = turn % len(configs)
        for config in configs[k:] + configs[:k]:
            _apply(config, real_staging, real_window_for)
            request = bd._ours_sd(shapes, "cols", False)
            dist.barrier()
            if rank == 0:
                drop_page_cache()
            dist.barrier()
            start = time.perf_counter()
            dc.load(
                request,
                path,
                sharded_strategy=TorchDistLoadShardedStrategy(),
                validate_access_integrity=False,
            )
            dist.barrier()
            times[config].append(time.perf_counter() - start)
    _apply(configs[0], real_staging, real_window_for)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        queue.put(times)
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mib", type=int, default=1024, help="checkpoint size")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=["auto:2:4", "4:2:4", "8:2:4"])
    p.add_argument("--dir", default=os.environ.get("DIST_CKPT_BENCH_DIR", "/tmp"))
    args = p.parse_args(argv)
    times = run_world(_worker, args.world, args.dir, args.mib, args.rounds, args.configs)
    print(f"{args.world} ranks, {args.mib} MiB, column loads, seconds (median, then samples)")
    for config, xs in times.items():
        samples = " ".join(f"{x:.3f}" for x in xs)
        print(f"{config:>18s}  {statistics.median(xs):.3f}   {samples}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
