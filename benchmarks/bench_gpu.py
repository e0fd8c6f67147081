"""Checkpointing CUDA state: our paths against the copy floor, the disk ceiling and stock DCP.

One command on any CUDA machine (`python -m benchmarks.bench_gpu`): every rank holds
`--size-mib / world` MiB of `--dtype` CUDA tensors; world sizes 1 and the number of GPUs
(when more than one). Per world size, in one run, medians of `--repeats` (max over ranks):

- pinned D2H copy: `copy_(non_blocking=True)` into preallocated pinned host buffers (the
  floor of any save that leaves the GPU);
- raw O_DIRECT write / read of the same bytes from an aligned pinned buffer, 64 MiB
  requests, fsync (the disk ceiling);
- `torch.save` + fsync, and `torch.load(map_location=cuda)`;
- stock DCP: `dcp.save`, `dcp.load`, and `dcp.async_save` on a `cpu:gloo,cuda:nccl`
  group with its default staging and with `DefaultStager` (pinned memory, async staging);
- ours: `dist_checkpointing.save` (`torch_dist`) sync, load, and async (blocked = what
  `save()` + `schedule_async_request` take, committed = after `metadata.json`);
- local: `LocalCheckpointManager` sync and async (blocked, committed) and its load.

Every load goes into CUDA tensors and is compared bit-exactly with what was saved
(a mismatch aborts the run). Before every repeat of every read row (raw read included) the
page cache is dropped: `sync; echo 3 > /proc/sys/vm/drop_caches` where the run may (root,
writable /proc/sys), else `posix_fadvise(DONTNEED)` on each file about to be read; the row
`page cache before reads` says which worked ("not dropped" means reads may be served from
memory). `--sync-files N ...` adds rows of our sync save with N files per rank (the
default rule's choice is the row `ours default files per rank`). Output: one table per
world size and `--json`.

The stock pinned-stager row reuses one `DefaultStager` across repeats (as a training loop
would, so its pinned buffers are cached after the first save) where torch allows it; where
a stager clears its state after each stage (torch 2.11), a new one is made per save, before
the timer starts (`...: stagers made` says which).

`--device cpu` runs the same rows on CPU tensors (pageable instead of pinned memory, gloo
only) to check the script on a machine without a GPU; its figures say nothing about GPUs.

    python -m benchmarks.bench_gpu --size-mib 4096 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.distributed as dist

from benchmarks._common import drop_page_cache, free_port, print_table, write_json

_CHUNK = 64 << 20
_ALIGN = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return float(t[0])


_CPU_GROUP: Any = None


def _cpu_group() -> Any:
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def _barrier() -> None:
    dist.barrier(group=_cpu_group())


def _host(nbytes: int, pinned: bool) -> torch.Tensor:
    """A 4096-aligned uint8 host buffer of `nbytes` (pinned when asked)."""
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8, pin_memory=pinned)
    start = (-raw.data_ptr()) % _ALIGN
    return raw[start : start + nbytes]


def _raw_write(path: str, buf: torch.Tensor) -> float:
    """O_DIRECT write (+fsync) of `buf` (length a multiple of 4096); seconds."""
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for s in range(0, len(view), _CHUNK):
            chunk = view[s : s + _CHUNK]
            while len(chunk):
                chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: str, buf: torch.Tensor) -> float:
    """O_DIRECT read of `path` into `buf`; seconds."""
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        got = 0
        while got < len(view):
            n = os.readv(fd, [view[got : min(len(view), got + _CHUNK)]])
            if n <= 0:
                raise OSError(f"{path}: short read")
            got += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _evict_files(path: str) -> bool:
    """`posix_fadvise(DONTNEED)` on every file under `path` (clean pages leave the cache)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    files = [path] if os.path.isfile(path) else []
    for root, _, names in os.walk(path):
        files += [os.path.join(root, n) for n in names]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def drop_cache_for(path: str, how: str = "auto") -> str:
    """Drops the page cache before a read of `path`; returns how ("not dropped" if not).

    Args:
        path: the file or directory about to be read.
        how: "auto": the whole cache when the process may (root), else this path's files
            (works for any user: their pages are clean after the sync); "files": only
            this path's files (leaves a shared machine's cache alone); "none".
    """
    if how == "none":
        return "not dropped (--drop-cache none)"
    os.sync()
    if how == "auto" and drop_page_cache():
        return "dropped (drop_caches)"
    try:
        if _evict_files(path):
            return "dropped (fadvise DONTNEED per file)"
    except OSError:
        pass
    return "not dropped"


class _Stagers:
    """The pinned `DefaultStager` for each save: one reused across saves (as a training
    loop would, so its pinned buffers are cached), or a new one per save where torch
    clears a stager's state after each stage (2.11: reusing it then fails with
    `KeyError: <class 'type'>`)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.current, self.made = make, None, 0

    @staticmethod
    def _usable(stager: Any) -> bool:
        inner = getattr(stager, "_state_dict_stager", None)
        table = getattr(inner, "_deepcopy_dispatch", None)
        return not isinstance(table, dict) or bool(table)

    def __call__(self) -> Any:
        if self.current is not None and not self._usable(self.current):
            self.current.close()
            self.current = None
        if self.current is None:
            self.current = self.make()
            self.made += 1
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def _staging_options(options_cls: Any, pinned: bool) -> Any:
    """`StagingOptions` for a pinned, async, non-blocking stager, from the fields it has."""
    import dataclasses

    wanted = {
        "use_pinned_memory": pinned,
        "use_shared_memory": False,
        "use_async_staging": True,
        "use_non_blocking_copy": pinned,
    }
    if dataclasses.is_dataclass(options_cls):
        have = {f.name for f in dataclasses.fields(options_cls)}
        wanted = {k: v for k, v in wanted.items() if k in have}
    return options_cls(**wanted)


class _Bench:
    """One rank's state and the rows it measures."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.pinned = device.type == "cuda"
        dtype = getattr(torch, args.dtype)
        per_rank = (args.size_mib << 20) // world
        n = args.tensors
        elems = per_rank // n // torch.empty((), dtype=dtype).element_size()
        g = torch.Generator(device=device).manual_seed(rank)
        self.tensors = {
            f"t{i}": torch.randn(elems, generator=g, device=device, dtype=torch.float32).to(dtype)
            for i in range(n)
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.root = os.path.join(args.dir, f"w{world}")
        self.node = os.path.join(self.root, f"node{rank}")
        os.makedirs(self.node, exist_ok=True)
        self.out: Dict[str, Any] = {}
        self.drops: Set[str] = set()

    # ---- helpers ----
    def timed(
        self,
        name: str,
        fn: Callable[[], Any],
        after: Optional[Callable[[], Any]] = None,
        reads: Optional[str] = None,
    ) -> None:
        """Median over repeats of `fn` (max over ranks); for a read of `reads`, the page
        cache is dropped before each repeat (not timed)."""
        times = []
        for _ in range(self.args.repeats):
            if reads is not None:
                self.drop_cache(reads)
            _barrier()
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            times.append(_max(time.perf_counter() - t0))
            if after is not None:
                after()
        self.out[name] = statistics.median(times)

    def drop_cache(self, path: str) -> None:
        """Drops the page cache before a read row (see the module doc); records how."""
        self.drops.add(drop_cache_for(path, self.args.drop_cache))
        self.out["page cache before reads"] = " / ".join(sorted(self.drops))

    def check(self, what: str, loaded: Dict[str, torch.Tensor]) -> None:
        for k, t in self.tensors.items():
            got = loaded[k]
            if got.device.type != self.device.type or not torch.equal(got, t):
                raise AssertionError(
                    f"{what}: {k} differs from what was saved (or is on {got.device})"
                )

    def empty(self) -> Dict[str, torch.Tensor]:
        return {k: torch.empty_like(t) for k, t in self.tensors.items()}

    def clean(self, path: str) -> None:
        _barrier()
        if self.rank == 0 or path.startswith(self.node):
            shutil.rmtree(path, ignore_errors=True)
        _barrier()

    # ---- rows ----
    def floor_and_ceiling(self) -> None:
        host = {
            k: _host(t.numel() * t.element_size(), self.pinned) for k, t in self.tensors.items()
        }

        def copy() -> None:
            for k, t in self.tensors.items():
                host[k].view(t.dtype).copy_(t, non_blocking=self.pinned)

        self.timed("pinned D2H copy", copy)
        total = -(-self.nbytes // _ALIGN) * _ALIGN
        buf = _host(total, self.pinned)
        path = os.path.join(self.node, "raw.bin")
        runs = []
        for _ in range(self.args.repeats):
            _barrier()
            write = _max(_raw_write(path, buf))
            self.drop_cache(path)
            _barrier()
            runs.append((write, _max(_raw_read(path, buf))))
        os.remove(path)
        self.out["raw O_DIRECT write"] = statistics.median(w for w, _ in runs)
        self.out["raw O_DIRECT read"] = statistics.median(r for _, r in runs)

    def torch_save(self) -> None:
        path = os.path.join(self.node, "torch.pt")

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(self.tensors, f)
                f.flush()
                os.fsync(f.fileno())

        self.timed("torch.save", save)
        loaded: Dict[str, torch.Tensor] = {}
        self.timed(
            "torch.load",
            lambda: loaded.update(torch.load(path, map_location=self.device)),
            reads=path,
        )
        self.check("torch.load", loaded)
        os.remove(path)

    def stock_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp

        sd = {f"r{self.rank}.{k}": t for k, t in self.tensors.items()}
        ckpt = os.path.join(self.root, "dcp")
        self.timed("DCP save", lambda: dcp.save(sd, checkpoint_id=ckpt), lambda: None)
        target = {f"r{self.rank}.{k}": t for k, t in self.empty().items()}
        self.timed("DCP load", lambda: dcp.load(target, checkpoint_id=ckpt), reads=ckpt)
        self.check("DCP load", {k.split(".", 1)[1]: t for k, t in target.items()})
        self.clean(ckpt)
        self._dcp_async(sd, "DCP async (default staging)", None)
        stagers = None
        name = "DCP async (pinned stager)"
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = _staging_options(StagingOptions, self.pinned)
            stagers = _Stagers(lambda: DefaultStager(options))
            self._dcp_async(sd, name, stagers)
            self.out[f"{name}: stagers made"] = stagers.made
        except Exception as e:  # a stock failure is a result, not a crash of the run
            self.out[name] = f"failed: {type(e).__name__}: {e}"[:120]
        finally:
            if stagers is not None:
                stagers.close()

    def _dcp_async(
        self, sd: Dict[str, torch.Tensor], name: str, stagers: Optional[_Stagers]
    ) -> None:
        import torch.distributed.checkpoint as dcp

        blocked, staged, committed = [], [], []
        for i in range(self.args.repeats):
            ckpt = os.path.join(self.root, f"dcp_async_{i}")
            kwargs: Dict[str, Any] = {"checkpoint_id": ckpt, "process_group": dist.group.WORLD}
            if stagers is not None:
                kwargs["async_stager"] = stagers()
            _barrier()
            t0 = time.perf_counter()
            response = dcp.async_save(sd, **kwargs)
            blocked.append(_max(time.perf_counter() - t0))
            if hasattr(response, "staging_completion"):
                response.staging_completion.result()
                staged.append(_max(time.perf_counter() - t0))
                response.upload_completion.result()
            else:
                response.result()
            committed.append(_max(time.perf_counter() - t0))
            self.clean(ckpt)
        self.out[f"{name} blocks"] = statistics.median(blocked)
        if staged:
            self.out[f"{name} staged"] = statistics.median(staged)
        self.out[f"{name} committed"] = statistics.median(committed)

    def ours(self) -> None:
        import dist_checkpointing as dc
        from dist_checkpointing import ShardedTensor
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        def sharded(tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
            return {
                k: ShardedTensor.from_rank_offsets(k, t, (0, self.rank, self.world))
                for k, t in tensors.items()
            }

        from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        ckpt = os.path.join(self.root, "ours")
        self.out["ours default files per rank"] = TorchDistSaveShardedStrategy().thread_count
        self.timed(
            "ours sync save", lambda: dc.save(sharded(self.tensors), ckpt), lambda: self.clean(ckpt)
        )
        for n in self.args.sync_files:
            strategy = TorchDistSaveShardedStrategy(thread_count=n)
            self.timed(
                f"ours sync save, {n} files",
                lambda: dc.save(sharded(self.tensors), ckpt, sharded_strategy=strategy),
                lambda: self.clean(ckpt),
            )
        dc.save(sharded(self.tensors), ckpt)
        target = self.empty()
        self.timed("ours load", lambda: dc.load(sharded(target), ckpt), reads=ckpt)
        self.check("ours load", target)
        self.clean(ckpt)
        q = AsyncCallsQueue(persistent=True)
        blocked, committed = [], []
        for i in range(self.args.repeats):
            path = os.path.join(self.root, f"ours_async_{i}")
            _barrier()
            t0 = time.perf_counter()
            q.schedule_async_request(dc.save(sharded(self.tensors), path, async_sharded_save=True))
            blocked.append(_max(time.perf_counter() - t0))
            q.maybe_finalize_async_calls(blocking=True)
            committed.append(_max(time.perf_counter() - t0))
            self.clean(path)
        q.close()
        self.out["ours async blocks"] = statistics.median(blocked)
        self.out["ours async committed"] = statistics.median(committed)

    def local(self) -> None:
        from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
        from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        m = LocalCheckpointManager(self.node, "sync")
        it = iter(range(1, 1 << 30))
        self.timed(
            "local sync save",
            lambda: m.save(BasicTensorAwareStateDict(dict(self.tensors)), next(it)),
        )
        loaded: Dict[str, torch.Tensor] = {}

        def load() -> None:
            state, _ = LocalCheckpointManager(self.node, "sync").load()
            loaded.update(state.state_dict)

        self.timed("local load", load, reads=self.node)
        self.check("local load", loaded)
        q = AsyncCallsQueue()
        m = LocalCheckpointManager(self.node, "async")
        blocked, committed = [], []
        for i in range(self.args.repeats):
            _barrier()
            t0 = time.perf_counter()
            q.schedule_async_request(
                m.save(BasicTensorAwareStateDict(dict(self.tensors)), i + 1, is_async=True)
            )
            blocked.append(_max(time.perf_counter() - t0))
            q.maybe_finalize_async_calls(blocking=True)
            committed.append(_max(time.perf_counter() - t0))
        q.close()
        self.out["local async blocks"] = statistics.median(blocked)
        self.out["local async committed"] = statistics.median(committed)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    import datetime

    os.environ.setdefault("OMP_NUM_THREADS", "4")
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=30),
        device_id=device if device.type == "cuda" else None,
    )
    bench = _Bench(args, rank, world, device)
    bench.out["GB per rank"] = bench.nbytes / 1e9
    for step in (
        bench.floor_and_ceiling,
        bench.torch_save,
        bench.stock_dcp,
        bench.ours,
        bench.local,
    ):
        step()
    _barrier()
    if rank == 0:
        shutil.rmtree(bench.root, ignore_errors=True)
        queue.put(bench.out)
    dist.destroy_process_group()


def _rows(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    floor, ceiling = res["pinned D2H copy"], res["raw O_DIRECT write"]
    rows = []
    for key, value in res.items():
        if key == "GB per rank":
            continue
        row: Dict[str, Any] = {"what": key, "s": value}
        if isinstance(value, float):
            row["x copy floor"] = value / floor
            row["x write ceiling"] = value / ceiling
            row["GB/s per rank"] = res["GB per rank"] / value if value else None
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs every world size; returns `{world size: {row: seconds}}` (also printed)."""
    import torch.multiprocessing as mp

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (use --device cpu to check the script)")
    worlds = args.world_sizes
    if not worlds:
        n = torch.cuda.device_count() if args.device == "cuda" else 1
        worlds = [1] + ([n] if n > 1 else [])
    results: Dict[str, Any] = {}
    for world in worlds:
        shutil.rmtree(args.dir, ignore_errors=True)
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _worker,
            args=(world, args, free_port(), queue),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        res = queue.get()
        results[str(world)] = res
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (script check only)"
        print_table(
            f"{name}, {world} rank(s), {args.size_mib} MiB {args.dtype} in all, medians of {args.repeats}",
            _rows(res),
            ["what", "s", "x copy floor", "x write ceiling", "GB/s per rank"],
        )
    shutil.rmtree(args.dir, ignore_errors=True)
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=4096, help="state size over all ranks")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tensors", type=int, default=16, help="tensors per rank")
    p.add_argument("--world-sizes", type=int, nargs="*", default=[], help="default: 1 and #GPUs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--sync-files",
        type=int,
        nargs="*",
        default=[],
        help="extra rows: our sync save with these files (writer threads) per rank",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--drop-cache",
        choices=["auto", "files", "none"],
        default="auto",
        help="before reads: auto = drop_caches if root, else evict the files read; "
        "files = only evict the files read",
    )
    p.add_argument("--dir", default="/tmp/dist_ckpt_bench_gpu", help="on the disk to measure")
    p.add_argument("--json", default="")
    return p


def main() -> None:
    args = parser().parse_args()
    results = run(args)
    print(json.dumps(results, indent=1))
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "results": results,
                "rows": {w: _rows(r) for w, r in results.items()},
            },
        )


if __name__ == "__main__":
    main()
