"""The local tier's load, ours against nvidia-resiliency-ext's, interleaved in one world.

`bench_local` runs nvidia-resiliency-ext in its own world after ours, and takes one cold
sample of its load: the two loads then meet the disk at different times, and this disk's
cold reads drift by tens of percent within minutes. Here both libraries run in the same
processes, so their loads alternate sample by sample and the drift hits both alike. Run it
in a Python that has nvidia-resiliency-ext and torch, with this repository on PYTHONPATH
(the benchmark imports both; our package never imports nvidia-resiliency-ext):

    PYTHONPATH="$NVRX_PATH:$PWD" "$NVRX_PY" -m benchmarks.local_load_ab --world-size 2 \
        --mib-per-rank 512 --rounds 9

Each rank holds `--mib-per-rank` MiB of fp32 state in 8 tensors (as `bench_local`), in its
own "node" directory. Both managers use clique replication, jump 1, factor 2 (or
`--replication-factor`; 1: none), and save it
twice (the second save is the one loaded). Then `--rounds` rounds, in each of them, in an
order that rotates from round to round, after the page cache is dropped (needs root):
- `ours`: a fresh `LocalCheckpointManager`'s `load()` (find the newest complete iteration,
  map this rank's part, verify its checksums);
- `ours, copied`: the same load with the part read into fresh memory instead of mapped
  (what the load did before it mapped parts: the A/B of that mechanism);
- `nvrx`: a fresh nvidia-resiliency-ext manager's `find_latest()` + `load()`;
- `read`: one plain read of this rank's own part file into memory (`storage.read_file`),
  no checks: the disk's floor for the same bytes.
Every load is compared bit for bit with the saved state, outside the timed region. Times
are the max over ranks; prints one JSON line: medians (`"ours s"`, `"ours, copied s"`,
`"nvrx s"`, `"read s"`), `"ours / nvrx"`, `"ours / ours, copied"`, every sample, and the MiB rank 0's loads read from the disk (from
`/proc/self/io`: the part's size when the cache drop worked).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from benchmarks._common import drop_page_cache, init_world, max_over_ranks, rotated, run_world

_N_TENSORS = 8


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager as NvrxManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy as NvrxClique,
    )

    from benchmarks.nvrx_local_side import CpuStateDict
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from dist_checkpointing.local.ckpt_managers import local_manager
    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
    from dist_checkpointing.storage import read_file

    init_world(rank, world, port)
    torch.set_num_threads(1)
    per_rank = args.mib_per_rank << 20
    g = torch.Generator().manual_seed(rank)
    tensors = {
        f"t{i}": torch.randn(per_rank // _N_TENSORS // 4, generator=g) for i in range(_N_TENSORS)
    }
    node = os.path.join(args.dir, f"node{rank}")
    factor = args.replication_factor  # 1: neither library replicates
    ours_repl = CliqueReplicationStrategy.from_replication_params(1, factor) if factor > 1 else None
    nvrx_repl = NvrxClique.from_replication_params(1, factor) if factor > 1 else None
    ours = LocalCheckpointManager(os.path.join(node, "ours"), "ab", ours_repl)
    nvrx = NvrxManager(os.path.join(node, "nvrx"), "ab", nvrx_repl)
    for iteration in (1, 2):
        ours.save(BasicTensorAwareStateDict(dict(tensors)), iteration)
        nvrx.save(CpuStateDict(dict(tensors)), iteration)
    own_part = glob.glob(os.path.join(node, "ours", "**", f"iter_0000002_{rank}_*"), recursive=True)
    assert len(own_part) == 1, own_part

    loaded: List[Any] = []

    def load_ours() -> None:
        loaded.append(LocalCheckpointManager(os.path.join(node, "ours"), "ab", ours_repl).load())

    def load_ours_copied() -> None:
        mapping = local_manager.map_image
        local_manager.map_image = read_file  # the part read into fresh memory, not mapped
        try:
            load_ours()
        finally:
            local_manager.map_image = mapping

    def load_nvrx() -> None:
        fresh = NvrxManager(os.path.join(node, "nvrx"), "ab", nvrx_repl)
        fresh.find_latest()
        loaded.append(fresh.load())

    def read() -> None:
        read_file(own_part[0])

    samples: Dict[str, List[float]] = {}
    disk: Dict[str, List[int]] = {}
    rows: List[Any] = [
        ("ours", load_ours),
        ("ours, copied", load_ours_copied),
        ("nvrx", load_nvrx),
        ("read", read),
    ]
    for i in range(args.rounds):
        fn: Callable[[], None]
        for name, fn in rotated(rows, i):
            dist.barrier()
            if rank == 0:
                drop_page_cache()
            dist.barrier()
            io0 = _io_read_bytes()
            start = time.perf_counter()
            fn()
            samples.setdefault(name, []).append(max_over_ranks(time.perf_counter() - start))
            disk.setdefault(name, []).append(_io_read_bytes() - io0)
            if loaded:  # outside the timed region
                state = loaded.pop()[0].state_dict
                for key, want in tensors.items():
                    assert torch.equal(state[key], want), (name, key)
                del state  # a load's pages are not dropped while its tensors live
    if rank == 0:
        out: Dict[str, Any] = {f"{k} s": statistics.median(v) for k, v in samples.items()}
        out["ours / nvrx"] = out["ours s"] / out["nvrx s"]
        out["ours / ours, copied"] = out["ours s"] / out["ours, copied s"]
        out["samples"] = {k: [round(x, 3) for x in v] for k, v in samples.items()}
        # what the block layer read for rank 0's loads: about the part's size when the page
        # cache was dropped (0 where it could not be: not root)
        out["disk MiB read (rank 0)"] = {k: statistics.median(v) / 2**20 for k, v in disk.items()}
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--replication-factor", type=int, default=2, help="clique factor (1: not replicated)"
    )
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_local_ab")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        print(json.dumps(run_world(_worker, args.world_size, args)))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
