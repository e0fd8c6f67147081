"""O_DIRECT read rate by the kind of memory read into: what shared reads stage through.

Several processes each read their own file with O_DIRECT, one window at a time into a
ring of three windows (the shape of a shared-read reader), page cache dropped before
each trial. The windows are, by turn:

- `shared`: shared anonymous memory allocated in the trial (what a `/dev/shm` window is);
- `shared, earlier`: the same, allocated and touched once before the first trial;
- `private`: private anonymous memory, 4 KiB pages;
- `huge pages`: private anonymous memory with `MADV_HUGEPAGE` (`storage.buffers.staging`);
- `huge pages + copy`: reads into huge pages, each window then copied into a shared one
  in 1 MiB pieces (what a shared-read reader does).

Each trial's time is the slowest process's; the table prints every trial and the ratio of
the medians to `shared`. Needs root to drop the page cache (else each file is evicted
with `POSIX_FADV_DONTNEED`).

    python -m benchmarks.bench_direct_memory --procs 4 --mib 256 --trials 3
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

from benchmarks._common import drop_page_cache
from dist_checkpointing.storage.buffers import staging

KINDS = ["shared", "shared, earlier", "private", "huge pages", "huge pages + copy"]
#: piece a staged window is copied in (as `shared_read.LAND`)
PIECE = 1 << 20


def _memory(kind: str, nbytes: int) -> np.ndarray:
    """`nbytes` of the kind's memory, touched."""
    if kind.startswith("huge"):
        buf = staging(nbytes)
        if buf is None:
            raise SystemExit("this kernel gives no transparent huge pages")
    elif kind == "private":
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = np.frombuffer(m, dtype=np.uint8)
    else:
        buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buf[:] = 1
    return buf


def _reader(
    path: str, window: int, kind: str, earlier: Optional[np.ndarray], barrier: Any, out: Any
) -> None:
    """One process: reads `path` window by window into three windows of `kind`."""
    ring = earlier if earlier is not None else _memory(kind, 3 * window)
    shared = _memory("shared", 3 * window) if kind == "huge pages + copy" else None
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    barrier.wait()
    start = time.perf_counter()
    offset, k = 0, 0
    while offset < size:
        at = (k % 3) * window
        got = os.preadv(fd, [memoryview(ring[at : at + window])], offset)  # type: ignore[arg-type]
        if got <= 0:
            break
        if shared is not None:
            for p in range(at, at + got, PIECE):
                end = min(at + got, p + PIECE)
                shared[p:end] = ring[p:end]
        offset += got
        k += 1
    barrier.wait()
    out.put(time.perf_counter() - start)
    os.close(fd)


def _cold(paths: List[str]) -> None:
    if drop_page_cache():
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, default=4, help="reading processes")
    parser.add_argument("--mib", type=int, default=256, help="MiB each process reads")
    parser.add_argument("--window-mib", type=int, default=16, help="MiB per read request")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()
    window = args.window_mib << 20
    ctx = mp.get_context("fork")  # the `shared, earlier` windows are inherited
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        paths = [os.path.join(root, f"f{i}") for i in range(args.procs)]
        block = os.urandom(1 << 20)
        for p in paths:
            with open(p, "wb") as f:
                for _ in range(args.mib):
                    f.write(block)
                os.fsync(f.fileno())
        earlier = [_memory("shared", 3 * window) for _ in paths]
        times: Dict[str, List[float]] = {k: [] for k in KINDS}
        for _ in range(args.trials):
            for kind in KINDS:
                _cold(paths)
                barrier, out = ctx.Barrier(len(paths)), ctx.Queue()
                procs = [
                    ctx.Process(
                        target=_reader,
                        args=(
                            p,
                            window,
                            kind,
                            e if kind == "shared, earlier" else None,
                            barrier,
                            out,
                        ),
                    )
                    for p, e in zip(paths, earlier)
                ]
                for proc in procs:
                    proc.start()
                took = [out.get(timeout=600) for _ in procs]
                for proc in procs:
                    proc.join()
                times[kind].append(max(took))
    total = args.procs * args.mib / 1024
    print(
        f"{args.procs} processes x {args.mib} MiB ({total:.2f} GiB), "
        f"{args.window_mib} MiB requests, O_DIRECT, cold; seconds per trial"
    )
    base = statistics.median(times["shared"])
    for kind in KINDS:
        med = statistics.median(times[kind])
        samples = " ".join(f"{t:.3f}" for t in times[kind])
        print(
            f"  {kind:18s} {samples}   median {med:.3f} s, {total / med:.2f} GiB/s, "
            f"{base / med:.2f}x shared"
        )


if __name__ == "__main__":
    main()
