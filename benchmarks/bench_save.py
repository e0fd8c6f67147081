"""Synchronous saves only, methods alternated within each repeat, with each rank's CPU time.

A save-side companion to `bench_disk` for a noisy machine: each repeat saves once with every
method, in forward order on even repeats and reverse order on odd ones, so drifts of the
shared disk hit every method alike; every sample is printed beside the median. Methods
(fp32 state split on rows across ranks, the same layout as `bench_disk`):

- `ceiling`: raw O_DIRECT writes of each rank's bytes from aligned buffers (two files per
  rank written in parallel, 64 MiB requests, one fsync each);
- `torch.save`: each rank `torch.save`s its shards and fsyncs;
- `dcp`: stock `torch.distributed.checkpoint.save` of DTensors (its defaults);
- `megatron`: megatron-core's `dist_checkpointing.save` (torch_dist), when importable;
- `ours`: `dist_checkpointing.save` with the default `TorchDistSaveShardedStrategy()`;
- `ours-direct` / `ours-buffered`: the same with `direct_io=True` / `False` (the two write
  paths the default chooses between), `ours-tN`: with `thread_count=N`; suffixes combine
  (`ours-buffered-t2`).

CPU is `getrusage` user + system seconds of the save, summed over ranks.

    python -m benchmarks.bench_save --world-sizes 2 4 --size-mib 1024 --repeats 6 \\
        --methods ceiling dcp ours ours-direct ours-buffered
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks._common import init_world, median, run_world
from benchmarks.bench_disk import (
    _dtensors,
    _mcore_sd,
    _ours_sd,
    _parallel,
    _raw_write,
    _shapes,
    ceiling_files,
    torch_save_fn,
)


def _ours_options(method: str) -> Dict[str, Any]:
    """`TorchDistSaveShardedStrategy` keyword arguments of an `ours[-...]` method name."""
    kw: Dict[str, Any] = {}
    for part in method.split("-")[1:]:
        if part == "direct":
            kw["direct_io"] = True
        elif part == "buffered":
            kw["direct_io"] = False
        elif part.startswith("t") and part[1:].isdigit():
            kw["thread_count"] = int(part[1:])
        else:
            raise SystemExit(f"unknown method {method!r} (part {part!r})")
    return kw


def _save_fn(method: str, shapes: List[tuple], path: str) -> Callable[[], Any]:
    """A function saving the state once with `method` into `path` (state built outside it)."""
    if method == "ceiling":
        bufs, files = ceiling_files(shapes, path)
        return lambda: _parallel([lambda f=f, b=b: _raw_write(f, b) for f, b in zip(files, bufs)])
    if method == "torch.save":
        return torch_save_fn(shapes, path)
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        sd = _dtensors(shapes, "rows", True)
        return lambda: dcp.save(sd, checkpoint_id=path)
    if method == "megatron":
        from megatron.core import dist_checkpointing as mdc

        msd = _mcore_sd(shapes, "rows", True)
        return lambda: mdc.save(msd, path)
    import dist_checkpointing as dc
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    saver = TorchDistSaveShardedStrategy(**_ours_options(method))
    osd = _ours_sd(shapes, "rows", True)
    return lambda: dc.save(osd, path, sharded_strategy=saver)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _one(method: str, shapes: List[tuple], path: str) -> Tuple[float, float]:
    """Collective: (wall seconds from a barrier to the last rank done, CPU seconds over ranks)."""
    fn = _save_fn(method, shapes, path)
    dist.barrier()
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    cpu = _cpu() - c0
    dist.barrier()
    wall = time.perf_counter() - t0
    total = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(total)
    return wall, float(total[0])


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port, minutes=60)
    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core calls these on CPU too
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    __import__("torch.distributed.checkpoint")  # import costs kept out of the timings
    import dist_checkpointing.serialization as ser

    ser.get_default_save_sharded_strategy()
    methods = list(args.methods)
    if "megatron" in methods:
        try:
            __import__("megatron.core.dist_checkpointing")
        except Exception:
            methods.remove("megatron")
    shapes = _shapes(args.size_mib << 20, world)
    root = os.path.join(args.dir, f"w{world}")
    samples: Dict[str, List[Tuple[float, float]]] = {m: [] for m in methods}
    for rep in range(args.repeats):
        for m in methods if rep % 2 == 0 else methods[::-1]:
            path = os.path.join(root, f"{m.replace('.', '_')}_{rep}")
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            samples[m].append(_one(m, shapes, path))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    from dist_checkpointing.storage.write_probe import write_probe_result

    probe = write_probe_result(root)  # what the default (`ours`) chose, if it probed
    probes = [None] * world
    dist.all_gather_object(probes, None if probe is None else (probe.prefer_direct, probe.pairs))
    if rank == 0:
        queue.put((samples, sum(r * c * 4 for r, c in shapes), probes))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=["ceiling", "dcp", "ours"])
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_save")
    args = parser.parse_args()
    for m in args.methods:
        if m.startswith("ours"):
            _ours_options(m)  # unknown suffixes fail before any world starts
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    for world in args.world_sizes:
        start_load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        samples, nbytes, probes = run_world(_worker, world, args)
        end_load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"{world} ranks, {nbytes / 2**30:.2f} GiB, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
            f"load average {start_load} -> {end_load}; medians of {args.repeats} (alternated)"
        )
        ceiling = median([w for w, _ in samples.get("ceiling", [])])
        for m, got in samples.items():
            walls = [w for w, _ in got]
            rate = nbytes / median(walls) / 1e9
            ratio = f"  x ceil {ceiling / median(walls):.2f}" if "ceiling" in samples else ""
            print(
                f"  {m:18s} save GB/s {rate:.3f}{ratio}  cpu s {median([c for _, c in got]):.2f}"
                f"  samples GB/s {' '.join(f'{nbytes / w / 1e9:.3f}' for w in walls)}"
            )
        for r, probe in enumerate(probes):
            if probe is not None:
                pairs = ", ".join(f"{d * 1e3:.0f}/{b * 1e3:.0f}" for d, b in probe[1])
                way = "O_DIRECT" if probe[0] else "page cache"
                print(f"  rank {r} write probe: {way} (ms O_DIRECT/buffered per pair: {pairs})")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
