"""Shared helpers of the benchmarks: worlds, timing, page-cache drops, reporting."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_page_cache() -> bool:
    """Drops the OS page cache (needs root); returns whether it worked."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], Any]) -> float:
    """Collective: wall time of `fn` from a barrier until every rank finished it."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def rotated(items: List[Any], turn: int) -> List[Any]:
    """`items` rotated left by `turn` (modulo their number): the order of that turn when
    variants take turns going first."""
    k = turn % len(items) if items else 0
    return items[k:] + items[:k]


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_table(title: str, rows: List[Dict[str, Any]], columns: List[str]) -> None:
    print(title)
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  " + "  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def write_json(path: str, payload: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def model_shapes(total_bytes: int, world: int, n_tensors: int = 16) -> List[tuple]:
    """fp32 2-D shapes adding up to about `total_bytes`, both axes divisible by `world`."""
    per = total_bytes // n_tensors // 4
    cols = 1024
    rows = max(world, (per // cols) // (world * 4) * (world * 4))
    return [(rows, cols)] * n_tensors


def local_piece(i: int, shape: tuple, rank: int, world: int, axis: int) -> torch.Tensor:
    full_rows, full_cols = shape
    g = torch.Generator().manual_seed(i)
    if axis == 0:
        rows = full_rows // world
        return torch.randn(rows, full_cols, generator=g) + rank
    cols = full_cols // world
    return torch.randn(full_rows, cols, generator=g) + rank


def init_world(rank: int, world: int, port: int, minutes: int = 30) -> None:
    """Joins a gloo world on localhost (benchmark workers)."""
    import datetime

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=minutes),
    )


def max_over_ranks(x: float) -> float:
    """Collective: the largest `x` over ranks (the slowest rank sets a step's time)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def run_world(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """Runs `worker(rank, world, *args, port, queue)` on `world` spawned ranks; returns what
    rank 0 put on the queue."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        worker,
        args=(world, *args, free_port(), queue),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return queue.get()
