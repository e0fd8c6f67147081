"""Save / load / resharded-load throughput: ours ('torch_dist') against the baselines.

Same data, same run, same directory, for each method:
- `torch.save`: each rank torch.save's its shards (+ fsync); a resharded load makes every
  rank read every file and slice what it needs;
- `dcp`: stock torch.distributed.checkpoint with DTensors (Shard on the split axis);
- `ours`: dist_checkpointing.save / load with the default ('torch_dist', 1) backend
  (checksums written and verified);
- `ours-nocheck`: the same without checksums (to measure their cost).

The state is fp32, split on axis 0 across ranks; the resharded load asks for axis 1.
Figures are medians over --repeats; GB/s counts the global state size. The page cache is
dropped before each load when possible (root). Prints a table and writes JSON.

    python -m benchmarks.bench_save_load --world-size 2 --total-mib 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import (
    drop_page_cache,
    free_port,
    fsync_tree,
    local_piece,
    median,
    model_shapes,
    print_table,
    timed,
    write_json,
)

METHODS = ["torch.save", "dcp", "ours", "ours-nocheck"]


def _ours(shapes: List[tuple], rank: int, world: int, axis: int, data: bool) -> Dict[str, Any]:
    from dist_checkpointing import ShardedTensor

    sd = {}
    for i, shape in enumerate(shapes):
        t = (
            local_piece(i, shape, rank, world, axis)
            if data
            else torch.empty_like(local_piece(i, shape, rank, world, axis))
        )
        sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", t, (axis, rank, world))
    return sd


def _dtensors(shapes: List[tuple], rank: int, world: int, axis: int, data: bool) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i, shape in enumerate(shapes):
        t = local_piece(i, shape, rank, world, axis)
        if not data:
            t = torch.empty_like(t)
        out[f"t{i}"] = DTensor.from_local(t, mesh, [Shard(axis)], run_check=False)
    return out


def _run_method(
    method: str, shapes: List[tuple], root: str, rank: int, world: int, repeats: int
) -> Dict[str, List[float]]:
    import torch.distributed.checkpoint as dcp

    import dist_checkpointing as dc

    times: Dict[str, List[float]] = {"save": [], "load": [], "resharded load": []}
    for rep in range(repeats):
        path = os.path.join(root, f"{method.replace('.', '_')}_{rep}")
        saver: Any = None
        loader: Any = None
        if method.startswith("ours"):
            from dist_checkpointing.strategies.torch import (
                TorchDistLoadShardedStrategy,
                TorchDistSaveShardedStrategy,
            )

            check = method == "ours"
            saver = TorchDistSaveShardedStrategy(checksums=check)
            loader = TorchDistLoadShardedStrategy(verify_checksums=check)
            sd = _ours(shapes, rank, world, 0, True)
            times["save"].append(timed(lambda: dc.save(sd, path, sharded_strategy=saver)))
        elif method == "dcp":
            sd = _dtensors(shapes, rank, world, 0, True)
            times["save"].append(timed(lambda: dcp.save(sd, checkpoint_id=path)))
        else:
            local = {f"t{i}": local_piece(i, s, rank, world, 0) for i, s in enumerate(shapes)}

            def save_each() -> None:
                os.makedirs(path, exist_ok=True)
                torch.save(local, os.path.join(path, f"rank{rank}.pt"))
                fsync_tree(path) if rank == 0 else None

            times["save"].append(timed(save_each))
        for kind, axis in (("load", 0), ("resharded load", 1)):
            if rank == 0:
                drop_page_cache()
            dist.barrier()
            if method.startswith("ours"):
                req = _ours(shapes, rank, world, axis, False)
                times[kind].append(timed(lambda: dc.load(req, path, sharded_strategy=loader)))
            elif method == "dcp":
                dreq = _dtensors(shapes, rank, world, axis, False)
                times[kind].append(timed(lambda: dcp.load(dreq, checkpoint_id=path)))
            elif axis == 0:
                times[kind].append(
                    timed(
                        lambda: torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=True)
                    )
                )
            else:

                def gather_all() -> None:
                    pieces = [
                        torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=True)
                        for r in range(world)
                    ]
                    for i, s in enumerate(shapes):
                        full = torch.cat([p[f"t{i}"] for p in pieces], dim=0)
                        cols = s[1] // world
                        full[:, rank * cols : (rank + 1) * cols].clone()

                times[kind].append(timed(gather_all))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    return times


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(minutes=30),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    import torch.distributed.checkpoint as _dcp  # noqa: F401  (import cost kept out of the timings)

    import dist_checkpointing.serialization as ser

    ser.get_default_save_sharded_strategy()
    shapes = model_shapes(args.total_mib << 20, args.world_size)
    results = {
        m: _run_method(m, shapes, args.dir, rank, args.world_size, args.repeats)
        for m in args.methods
    }
    if rank == 0:
        queue.put((sum(r * c * 4 for r, c in shapes), results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--json", default="", help="write results here too")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker,
        args=(args, free_port(), queue),
        nprocs=args.world_size,
        join=True,
        start_method="spawn",
    )
    nbytes, results = queue.get()
    cache = drop_page_cache()
    rows = []
    for m, t in results.items():
        row: Dict[str, Any] = {"method": m}
        for kind in ("save", "load", "resharded load"):
            s = median(t[kind])
            row[f"{kind} s"] = s
            row[f"{kind} GB/s"] = nbytes / s / 1e9
        rows.append(row)
    base = {r["method"]: r for r in rows}
    for r in rows:
        for kind in ("save", "load", "resharded load"):
            if "torch.save" in base:
                r[f"{kind} vs torch.save"] = base["torch.save"][f"{kind} s"] / r[f"{kind} s"]
            if "dcp" in base:
                r[f"{kind} vs dcp"] = base["dcp"][f"{kind} s"] / r[f"{kind} s"]
    title = (
        f"{args.world_size} ranks, {nbytes / 2**30:.2f} GiB fp32, median of {args.repeats}, "
        f"page cache {'dropped' if cache else 'NOT dropped (not root)'} before loads"
    )
    cols = (
        ["method"]
        + [f"{k} GB/s" for k in ("save", "load", "resharded load")]
        + [f"{k} vs {b}" for b in ("torch.save", "dcp") for k in ("save", "load", "resharded load")]
    )
    print_table(title, rows, cols)
    payload = {
        "world_size": args.world_size,
        "bytes": nbytes,
        "repeats": args.repeats,
        "cache_dropped": cache,
        "raw_seconds": results,
        "rows": rows,
    }
    print(json.dumps(payload["rows"], indent=1))
    if args.json:
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
