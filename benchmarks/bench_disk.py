"""Save / load / resharded load against the disk's ceiling, every method in one run.

For each world size in --world-sizes and each total size in --sizes-mib (fp32 state split
on rows across ranks, same directory, page cache dropped before each load):

- `ceiling`: raw writes of each rank's bytes from aligned buffers (64 MiB requests, two
  files per rank written in parallel, one fsync each) both ways, O_DIRECT and through the
  page cache, and reads of them back into the same buffers, cold, three ways: O_DIRECT
  (64 MiB requests, both files at once) and through the page cache (16 MiB requests, one
  file after the other, and both files at once). The save and load ceilings are the
  fastest of these raw paths (each path's median over the repeats): what the disk gives;
- `torch.save`: each rank `torch.save`s its shards and fsyncs; loads read them back;
- `dcp`: stock `torch.distributed.checkpoint` with DTensors;
- `megatron`: megatron-core's `dist_checkpointing` (torch_dist), when importable;
- `ours`: `dist_checkpointing` with the default ('torch_dist', 1) backend and its defaults
  (checksums on, O_DIRECT writes, reads through the page cache);
- `ours-pagecache` (only when asked for): saved with `direct_io=False` (the A/B of O_DIRECT
  writes); `ours-nocheck`: loaded without verifying checksums (what verification costs);
  `ours-1thread`: loaded with one reading thread per rank (the A/B of reading two files at
  once).

The methods take turns within each repeat, in an order rotated every repeat, so a drift of
the disk's speed over the run (the host's cache, other jobs) falls on each of them alike.
In each repeat every method saves first, then every method loads (in the same order): a
load reads a checkpoint at rest, as a restarting job does, not one its own save wrote a
moment before.

Two resharded loads: `reshard rows` asks every rank for a block of rows shifted by half a
stored block (each request spans two stored chunks, half of each; the last rank's block
wraps around to the first half block, so every row is read by exactly one rank; DTensor and
megatron cannot express it), `reshard cols` asks for column blocks (each rank needs a slice of
every stored chunk). GB/s counts the state size once; ratios are against the ceiling of
the same run (write for saves, read for loads).

Loads fill destination tensors written once before (resident, as a model's parameters are
when a checkpoint is loaded into it, and as the ceiling's read buffers are);
`--fresh-destinations` loads into never-touched tensors instead, so every method also pays the
kernel's zeroing of each page it fills (torch.load always allocates its own).

    python -m benchmarks.bench_disk --world-sizes 2 4 --sizes-mib 1024 4096 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from benchmarks._common import (
    drop_page_cache,
    init_world,
    median,
    print_table,
    rotated,
    run_world,
    timed,
    write_json,
)

KINDS = ["save", "load", "reshard rows", "reshard cols"]
#: the ceiling's two raw read paths (its "load" is the faster of them in each repeat)
CEILING_READS = ["load O_DIRECT", "load page cache", "load page cache x2"]
#: the ceiling's two raw write paths (its "save" is the faster of them in each repeat)
CEILING_WRITES = ["save O_DIRECT", "save page cache"]
CEILING_KINDS = CEILING_READS + CEILING_WRITES
#: the methods that run this library (see the module docstring)
OURS = ("ours", "ours-nocheck", "ours-pagecache", "ours-1thread")


#: seconds of idle disk before each timed save and load (`--settle`): a virtual disk's host
#: can still be writing back a previous save's bytes after its fsync returned, and slowed
#: whichever method ran next (below)
SETTLE_S = 0.0


def _settle() -> None:
    """Flushes the guest's dirty pages and leaves the disk idle for `SETTLE_S` seconds."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    time.sleep(SETTLE_S)
    dist.barrier()


#: how loads start cold (`--cold`): "drop" drops the whole page cache; "evict" evicts only
#: the files under `COLD_DIR` (flushed, then `POSIX_FADV_DONTNEED`), leaving the rest of
#: the machine's memory as it was
COLD = "drop"
COLD_DIR = ""


def _evict(root: str) -> None:
    """Flushes and evicts every file under `root` from the page cache."""
    for top, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cold() -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        if COLD == "evict":
            _evict(COLD_DIR)
        else:
            drop_page_cache()
    dist.barrier()
    _settle()


def _shapes(total: int, world: int) -> List[tuple]:
    n = 16
    cols = 1024
    rows = max(world * 8, (total // n // 4 // cols) // (world * 8) * (world * 8))
    return [(rows, cols)] * n


def _piece(i: int, shape: tuple, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    base = torch.randn(1, shape[1], generator=g)
    rows = torch.arange(r0, r1, dtype=torch.float32).unsqueeze(1)
    return (rows * 1e-3 + base[:, c0:c1]).contiguous()


def _blocks(shape: tuple, rank: int, world: int, kind: str) -> tuple:
    """(r0, r1, c0, c1) of this rank's piece for a layout kind."""
    rows, cols = shape
    b = rows // world
    if kind == "rows":
        return rank * b, (rank + 1) * b, 0, cols
    if kind == "shifted":  # the last rank's block wraps: its rows past the end (see _ours_sd)
        start = rank * b + b // 2
        return start, min(rows, start + b), 0, cols
    c = cols // world
    return 0, rows, rank * c, (rank + 1) * c


#: load destinations are written once before the load (resident, as a model's parameters are
#: when a checkpoint is loaded into it, and as the ceiling's buffers are); `--fresh-destinations`
#: leaves them untouched, so the load also pays the kernel's zeroing of every page it fills
FRESH_DESTINATIONS = False


def _dest(rows: int, cols: int) -> torch.Tensor:
    return torch.empty(rows, cols) if FRESH_DESTINATIONS else torch.zeros(rows, cols)


def _ours_sd(shapes: List[tuple], kind: str, data: bool) -> Dict[str, Any]:
    from dist_checkpointing import ShardedTensor

    r, w = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, s in enumerate(shapes):
        r0, r1, c0, c1 = _blocks(s, r, w, kind)
        t = _piece(i, s, r0, r1, c0, c1) if data else _dest(r1 - r0, c1 - c0)
        out[f"t{i}"] = ShardedTensor(f"t{i}", t, t.dtype, tuple(t.shape), s, (r0, c0), None)
        if kind == "shifted" and r == w - 1:  # the wrapped part: the first half block
            h = s[0] // w // 2
            t0 = _dest(h, s[1])
            wrap = ShardedTensor(f"t{i}", t0, t0.dtype, tuple(t0.shape), s, (0, 0), None)
            out[f"t{i}"] = [out[f"t{i}"], wrap]
    return out


def _dtensors(shapes: List[tuple], kind: str, data: bool) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    r, w = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    out = {}
    for i, s in enumerate(shapes):
        r0, r1, c0, c1 = _blocks(s, r, w, kind)
        t = _piece(i, s, r0, r1, c0, c1) if data else _dest(r1 - r0, c1 - c0)
        out[f"t{i}"] = DTensor.from_local(
            t, mesh, [Shard(0 if kind == "rows" else 1)], run_check=False
        )
    return out


def _mcore_sd(shapes: List[tuple], kind: str, data: bool) -> Dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor as MST

    r, w = dist.get_rank(), dist.get_world_size()
    axis = 0 if kind == "rows" else 1
    out = {}
    for i, s in enumerate(shapes):
        r0, r1, c0, c1 = _blocks(s, r, w, kind)
        t = _piece(i, s, r0, r1, c0, c1) if data else _dest(r1 - r0, c1 - c0)
        out[f"t{i}"] = MST.from_rank_offsets(f"t{i}", t, (axis, r, w))
    return out


# ---- the ceiling: raw O_DIRECT I/O of the same bytes ---------------------------------------


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(4096, -(-n // 4096) * 4096)), dtype=np.uint8)


def _raw_write(path: str, buf: np.ndarray, direct: bool = True) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        for off in range(0, buf.size, 64 << 20):
            os.pwrite(fd, memoryview(buf[off : off + (64 << 20)]), off)  # type: ignore[arg-type]
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path: str, buf: np.ndarray, direct: bool = True) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    step = (64 if direct else 16) << 20
    try:
        for off in range(0, buf.size, step):
            os.preadv(fd, [memoryview(buf[off : off + step])], off)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def _parallel(fns: List[Callable[[], Any]]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def ceiling_files(shapes: List[tuple], path: str) -> Tuple[List[np.ndarray], List[str]]:
    """The ceiling's two aligned, filled buffers holding this rank's bytes and the two files
    they are written to in `path`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = sum(r * c * 4 for r, c in shapes) // world
    bufs = [_aligned(nbytes // 2) for _ in range(2)]
    for b in bufs:
        b[:] = 7
    return bufs, [os.path.join(path, f"raw_{rank}_{i}") for i in range(2)]


def torch_save_fn(shapes: List[tuple], path: str) -> Callable[[], None]:
    """A function that `torch.save`s this rank's row block of every tensor into
    `path/rank<r>.pt` and fsyncs it (the state is built here, outside the timing)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = {f"t{i}": _piece(i, s, *_blocks(s, rank, world, "rows")) for i, s in enumerate(shapes)}

    def save_each() -> None:
        with open(os.path.join(path, f"rank{rank}.pt"), "wb") as f:
            torch.save(local, f)
            f.flush()
            os.fsync(f.fileno())

    return save_each


def _path(root: str, method: str, rep: int) -> str:
    return os.path.join(root, f"{method.replace('.', '_')}_{rep}")


def _save(
    method: str, shapes: List[tuple], root: str, rep: int, times: Dict[str, List[float]]
) -> Any:
    """One repeat of one method's save, its time appended to `times`; returns what its
    loads need (the ceiling's buffers and files, or None)."""
    rank = dist.get_rank()
    path = _path(root, method, rep)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    if method == "ceiling":
        bufs, files = ceiling_files(shapes, path)
        # both write paths, in an order that alternates by repeat; the one written last
        # stays on disk and is read back (the other's files are removed first)
        ways = {"save page cache": (False, bufs), "save O_DIRECT": (True, bufs)}
        for name in rotated(list(ways), rep):
            direct, src = ways[name]
            for f in files:
                if os.path.exists(f):
                    os.unlink(f)
            _settle()  # each write path on an idle disk
            times[name].append(timed(_each(files, src, lambda f, b, d=direct: _raw_write(f, b, d))))
        return bufs, files
    _settle()
    if method in OURS:
        import dist_checkpointing as dc
        from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        saver = TorchDistSaveShardedStrategy(direct_io=method != "ours-pagecache")
        sd = _ours_sd(shapes, "rows", True)
        times["save"].append(timed(lambda: dc.save(sd, path, sharded_strategy=saver)))
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        dsd = _dtensors(shapes, "rows", True)
        times["save"].append(timed(lambda: dcp.save(dsd, checkpoint_id=path)))
    elif method == "megatron":
        from megatron.core import dist_checkpointing as mdc

        msd = _mcore_sd(shapes, "rows", True)
        times["save"].append(timed(lambda: mdc.save(msd, path)))
    else:  # torch.save
        times["save"].append(timed(torch_save_fn(shapes, path)))
    return None


def _each(
    files: List[str],
    bufs: List[np.ndarray],
    op: Callable[[str, np.ndarray], None],
    parallel: bool = True,
) -> Callable[[], Any]:
    """`op` on each of the ceiling's files of this rank: both at once, or one after the other."""
    calls = [lambda f=f, b=b: op(f, b) for f, b in zip(files, bufs)]
    return lambda: _parallel(calls) if parallel else [c() for c in calls]


def _load(
    method: str,
    shapes: List[tuple],
    root: str,
    rep: int,
    times: Dict[str, List[float]],
    saved: Any,
) -> None:
    """One repeat of one method's loads (cold), each time appended to `times`; then its
    checkpoint is removed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = _path(root, method, rep)
    if method == "ceiling":
        bufs, files = saved
        reads = {
            "load O_DIRECT": _each(files, bufs, _raw_read),
            "load page cache": _each(
                files, bufs, lambda f, b: _raw_read(f, b, direct=False), parallel=False
            ),
            "load page cache x2": _each(files, bufs, lambda f, b: _raw_read(f, b, direct=False)),
        }
        for name in rotated(list(reads), rep):
            _cold()
            times[name].append(timed(reads[name]))
    elif method in OURS:
        import dist_checkpointing as dc
        from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

        loader = TorchDistLoadShardedStrategy(
            verify_checksums=method != "ours-nocheck",
            thread_count=1 if method == "ours-1thread" else 2,
        )
        for kind, layout in (
            ("load", "rows"),
            ("reshard rows", "shifted"),
            ("reshard cols", "cols"),
        ):
            req = _ours_sd(shapes, layout, False)
            _cold()
            times[kind].append(
                timed(
                    lambda: dc.load(
                        req, path, sharded_strategy=loader, validate_access_integrity=False
                    )
                )
            )
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        for kind, layout in (("load", "rows"), ("reshard cols", "cols")):
            dreq = _dtensors(shapes, layout, False)
            _cold()
            times[kind].append(timed(lambda: dcp.load(dreq, checkpoint_id=path)))
    elif method == "megatron":
        from megatron.core import dist_checkpointing as mdc

        for kind, layout in (("load", "rows"), ("reshard cols", "cols")):
            mreq = _mcore_sd(shapes, layout, False)
            _cold()
            times[kind].append(timed(lambda: mdc.load(mreq, path)))
    else:  # torch.save
        _cold()
        times["load"].append(
            timed(lambda: torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=True))
        )

        def gather_cols() -> None:  # one rank file at a time: keep only this rank's columns
            parts: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(shapes))}
            for r in range(world):
                piece = torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=True)
                for i, s in enumerate(shapes):
                    c = s[1] // world
                    parts[i].append(piece[f"t{i}"][:, rank * c : (rank + 1) * c].clone())
                del piece
            for i in parts:
                torch.cat(parts[i], dim=0)

        _cold()
        times["reshard cols"].append(timed(gather_cols))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    # megatron-core warns about missing GPU extras and deprecated calls in every rank
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
    init_world(rank, world, port, minutes=60)
    global FRESH_DESTINATIONS, SETTLE_S, COLD, COLD_DIR
    FRESH_DESTINATIONS = args.fresh_destinations
    COLD, COLD_DIR = args.cold, args.dir
    SETTLE_S = args.settle
    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core calls these on CPU too
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    import importlib

    importlib.import_module("torch.distributed.checkpoint")  # import cost kept out of the timings

    import dist_checkpointing.serialization as ser

    ser.get_default_save_sharded_strategy()
    methods = list(args.methods)
    if "megatron" in methods:  # imported only when measured: its import (2800 modules) is
        # a process-wide change the other methods should not run under unless asked to
        try:
            import megatron.core.dist_checkpointing  # noqa: F401
        except Exception:
            methods = [m for m in methods if m != "megatron"]
    out: Dict[int, Dict[str, Any]] = {}
    for size in args.sizes_mib:
        shapes = _shapes(size << 20, world)
        per: Dict[str, Any] = {m: {k: [] for k in KINDS + CEILING_KINDS} for m in methods}
        for rep in range(args.repeats):
            # methods take turns, in an order rotated every repeat: the disk's drift over the
            # run (the host's cache, other jobs) falls on each of them alike
            # every method saves, then every method loads: a load reads a checkpoint at
            # rest, not one whose writes the host may still be flushing (which slowed
            # whichever load came right after its own save)
            root = os.path.join(args.dir, f"w{world}")
            order = rotated(methods, rep)
            saved = {m: _save(m, shapes, root, rep, per[m]) for m in order}
            for m in order:
                _load(m, shapes, root, rep, per[m], saved[m])
        per["_bytes"] = sum(r * c * 4 for r, c in shapes)
        out[size] = per
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _ceiling(t: Dict[str, List[float]]) -> Dict[str, float]:
    """The ceiling's save and load seconds: the fastest raw path's median.

    Each path's samples are reduced the way every method's are (the median over repeats)
    before the fastest is picked: the fastest path of each repeat would be the best of
    three draws of a noisy disk set against one draw of each method.
    """
    out = {}
    for kind, paths in (("save", CEILING_WRITES), ("load", CEILING_READS)):
        medians = [median(t[p]) for p in paths if t.get(p)]
        if medians:
            out[kind] = min(medians)
    return out


def _rows(res: Dict[int, Any], world: int) -> List[Dict[str, Any]]:
    """Table rows of one world size's results (GB/s and ratios to the ceiling)."""
    rows = []
    for _size, per in res.items():
        nbytes = per["_bytes"]
        ceil = _ceiling(per["ceiling"]) if "ceiling" in per else {}
        for method, t in per.items():
            if method.startswith("_"):  # the size's facts (bytes), no method
                continue
            row: Dict[str, Any] = {
                "GiB": round(nbytes / 2**30, 2),
                "ranks": world,
                "method": method,
            }
            for kind in KINDS + CEILING_KINDS:
                if method == "ceiling" and kind in ceil:
                    s = ceil[kind]
                elif t.get(kind):
                    s = median(t[kind])
                else:
                    continue
                row[f"{kind} GB/s"] = nbytes / s / 1e9
                ref = ceil.get("save" if kind == "save" else "load")
                if ref and kind in KINDS:
                    row[f"{kind} x ceil"] = ref / s
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--methods", nargs="+", default=["ceiling", "torch.save", "dcp", "megatron", "ours"]
    )
    parser.add_argument(
        "--fresh-destinations",
        action="store_true",
        help="load into never-touched tensors (the load pays their page faults); default: "
        "into tensors written once before, like a model's parameters",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds of idle disk before each timed save and load (default 3): with none, "
        "on the CI VM a method's load or save ran up to 4x slower right after another "
        "method's save, whose bytes the host was still writing back",
    )
    parser.add_argument(
        "--cold",
        choices=["drop", "evict"],
        default="drop",
        help="how each load starts cold: drop the whole page cache (default), or evict only "
        "the benchmark's files (the rest of memory untouched; see docs/performance.md)",
    )
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_disk")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows: List[Dict[str, Any]] = []
    raw: Dict[str, Any] = {}
    cols = (
        ["GiB", "ranks", "method"]
        + [f"{k} GB/s" for k in KINDS + CEILING_KINDS]
        + [f"{k} x ceil" for k in KINDS]
    )
    for world in args.world_sizes:
        done = []
        for size in args.sizes_mib:  # one world per size: a finished size is kept if a later
            # one fails (e.g. runs out of memory)
            res = run_world(
                _worker, world, argparse.Namespace(**{**vars(args), "sizes_mib": [size]})
            )
            raw.setdefault(str(world), {}).update(res)
            done += _rows(res, world)
        rows += done
        # each world size's table as soon as it is measured (a long run shows progress,
        # and an interrupted one keeps what it measured)
        print_table(
            f"{world} ranks, {time.strftime('%Y-%m-%d %H:%M:%S')}, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}: medians of {args.repeats}; "
            "page cache dropped before loads; "
            f"{'fresh' if args.fresh_destinations else 'resident'} load destinations; x ceil: ratio to the raw ceiling of the same "
            "run (the fastest raw path's median)",
            done,
            cols,
        )
        sys.stdout.flush()
    if len(args.world_sizes) > 1:
        print_table(f"all world sizes, medians of {args.repeats}", rows, cols)
    print(json.dumps(rows, indent=1))
    if args.json:
        write_json(args.json, {"rows": rows, "raw": raw})
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
