"""How a process should read its data file cold: requests in flight, threads, read path.

N processes each read their own file (the layout of a plain load: one data file per rank)
in 16 chunks, into fresh destination memory, the page cache dropped before every round;
the patterns alternate round by round so the machine's noise hits them all alike:

- `page cache, 1 in flight`: the chunks in file order, one 16 MiB request at a time
  (the kernel's readahead keeps the disk busy): what loads do now;
- `page cache, 4 in flight`: the same, 8 MiB requests, 4 in flight;
- `2 threads x 4 in flight`: chunks handed to 2 threads (as loads did before), each
  chunk read in 8 MiB requests, 4 in flight;
- `O_DIRECT, 4 in flight`: the chunks in file order, 8 MiB requests, 4 in flight
  (through the bounce buffer where the destination is unaligned).

Prints the median wall time of the slowest process and every sample.

    python -m benchmarks.bench_read_patterns --processes 2 4 --total-mib 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

import torch

from benchmarks._common import drop_page_cache
from dist_checkpointing.storage import read_region

CHUNKS = 16
PATTERNS = [
    "page cache, 1 in flight",
    "page cache, 4 in flight",
    "2 threads x 4 in flight",
    "O_DIRECT, 4 in flight",
]


def _read(args: Tuple[str, int, str]) -> float:
    path, size, pattern = args
    chunk = size // CHUNKS
    dests = [torch.empty(chunk, dtype=torch.uint8).numpy() for _ in range(CHUNKS)]
    start = time.perf_counter()
    if pattern == "2 threads x 4 in flight":

        def one(k: int) -> None:
            read_region(path, k * chunk, dests[k], False, request=8 << 20, depth=4)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(CHUNKS)))
    else:
        direct = pattern.startswith("O_DIRECT")
        request, depth = (16 << 20, 1) if pattern.endswith("1 in flight") else (8 << 20, 4)
        for k in range(CHUNKS):
            read_region(path, k * chunk, dests[k], direct, request=request, depth=depth)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_read_patterns")
    args = parser.parse_args()
    if not drop_page_cache():
        print("warning: cannot drop the page cache (not root): reads may be warm")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    ctx = mp.get_context("fork")
    try:
        for n in args.processes:
            size = (args.total_mib << 20) // n // CHUNKS * CHUNKS
            paths = [os.path.join(args.dir, f"{n}_{i}") for i in range(n)]
            for p in paths:
                with open(p, "wb") as f:
                    block = os.urandom(1 << 20)
                    for _ in range(size >> 20):
                        f.write(block)
                    os.fsync(f.fileno())
            times: Dict[str, List[float]] = {p: [] for p in PATTERNS}
            for _ in range(args.rounds):
                for pattern in PATTERNS:
                    drop_page_cache()
                    with ctx.Pool(n) as pool:
                        times[pattern].append(
                            max(pool.map(_read, [(p, size, pattern) for p in paths]))
                        )
            print(
                f"{n} processes x {size >> 20} MiB, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
                f"medians of {args.rounds} alternating rounds:"
            )
            for pattern in PATTERNS:
                med = statistics.median(times[pattern])
                samples = ", ".join(f"{t:.2f}" for t in times[pattern])
                print(
                    f"  {pattern:26s} {med:6.3f} s  {n * size / med / 1e9:5.2f} GB/s  [{samples}]"
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
