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

With `--local`, two more patterns read a local checkpoint part per process (written by
`local._image.write_image`) with `local._read.read_part` itself (its reader threads for
that many ranks on the node, each tensor hashed as it lands):

- `local part, default depth`: `read_part` as it is (`local._read.DEPTH` None: the storage
  default, one request in flight through the page cache, as `torch_dist` loads);
- `local part, 4 in flight`: the same with `local._read.DEPTH = 4` (what it used before).

Prints the median wall time of the slowest process, every sample, and the median of the
largest CPU seconds (user + system) a process spent on a read.

    python -m benchmarks.bench_read_patterns --processes 2 4 --total-mib 1024 --rounds 5
    python -m benchmarks.bench_read_patterns --processes 2 4 --total-mib 1024 --rounds 4 --local
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
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
LOCAL_PATTERNS = ["local part, default depth", "local part, 4 in flight"]


def _write_part(path: str, size: int) -> None:
    """A local checkpoint part of `size` bytes of fp32 tensors (16 of them), fsync'd."""
    from dist_checkpointing.local._image import finish_image, start_image, write_image
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    g = torch.Generator().manual_seed(size)
    state = {f"t{k}": torch.randn(size // CHUNKS // 4, generator=g) for k in range(CHUNKS)}
    image = start_image(BasicTensorAwareStateDict(state), (1, 0, ""), stage=False)
    write_image(finish_image(image), path, fsync=True)


def _read_local(path: str, pattern: str) -> float:
    from dist_checkpointing.local import _read as local_read

    local_read.DEPTH = 4 if pattern.endswith("4 in flight") else None
    start = time.perf_counter()
    local_read.read_part(path)
    return time.perf_counter() - start


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _read(args: Tuple[str, int, str]) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one read."""
    c0 = _cpu()
    wall = _read_wall(args)
    return wall, _cpu() - c0


def _read_wall(args: Tuple[str, int, str]) -> float:
    path, size, pattern = args
    if pattern in LOCAL_PATTERNS:
        return _read_local(path + ".local", pattern)
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
    parser.add_argument(
        "--local", action="store_true", help="also read local checkpoint parts (read_part)"
    )
    parser.add_argument("--patterns", nargs="+", help="only these (names as printed)")
    args = parser.parse_args()
    patterns = PATTERNS + (LOCAL_PATTERNS if args.local else [])
    if args.patterns:
        patterns = [p for p in patterns if p in args.patterns]
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
                if args.local:
                    _write_part(p + ".local", size)
            if args.local:  # the read-path probe once, here: the forked readers inherit it
                from dist_checkpointing.storage import prefer_direct_reads

                path_used = "O_DIRECT" if prefer_direct_reads(paths[0] + ".local") else "page cache"
                print(f"local parts: read path chosen by the probe: {path_used}")
            # read_part's reader threads follow the ranks on the node
            os.environ["LOCAL_WORLD_SIZE"] = str(n)
            times: Dict[str, List[float]] = {p: [] for p in patterns}
            cpus: Dict[str, List[float]] = {p: [] for p in patterns}
            for _ in range(args.rounds):
                for pattern in patterns:
                    drop_page_cache()
                    with ctx.Pool(n) as pool:
                        got = pool.map(_read, [(p, size, pattern) for p in paths])
                    times[pattern].append(max(wall for wall, _ in got))
                    cpus[pattern].append(max(cpu for _, cpu in got))
            print(
                f"{n} processes x {size >> 20} MiB, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
                f"medians of {args.rounds} alternating rounds:"
            )
            for pattern in patterns:
                med = statistics.median(times[pattern])
                samples = ", ".join(f"{t:.2f}" for t in times[pattern])
                cpu = statistics.median(cpus[pattern])
                print(
                    f"  {pattern:26s} {med:6.3f} s  {n * size / med / 1e9:5.2f} GB/s  "
                    f"CPU {cpu:.2f} s/process  [{samples}]"
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
