"""nvidia-resiliency-ext's local checkpoint manager on CPU, for `bench_local` (run it in a
Python that has nvidia-resiliency-ext 0.4.1; it never imports dist_checkpointing).

NVRx 0.4.1's local checkpointing assumes CUDA: `BasicTensorAwareStateDict` asserts that
every tensor is on CUDA and moves tensors back with `.to("cuda")`. A subclass here accepts
CPU tensors and keeps them on the CPU; its replication (`CliqueReplicationStrategy`, jump
1, factor 2, gloo) and file writing are used as shipped. Same state as `bench_local`:
`--total-mib / world` MiB of fp32 per rank in 8 tensors, medians over `--repeats` saves
(max over ranks). Prints one JSON line: `{"nvrx f2 s": ..., "nvrx load s": ...}` (the load
right after the saves, page cache warm), `"nvrx load cold s"` (page cache dropped, as
`bench_local`'s loads) and `"nvrx bytes kept / state"` (its files per rank over the state).

    "$NVRX_VENV/bin/python" benchmarks/nvrx_local_side.py --world-size 2 --total-mib 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import time
from typing import Any

try:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict as _NvrxBasic,
    )
except ImportError:  # --help works without it; running needs it
    _NvrxBasic = object

_N_TENSORS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CpuStateDict(_NvrxBasic):  # type: ignore[misc, valid-type]
    """NVRx's BasicTensorAwareStateDict accepting CPU tensors and leaving them on the CPU
    (the stock class asserts CUDA and restores to CUDA)."""

    def __init__(self, state_dict: Any) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        pass


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=30),
    )
    per_rank = (args.total_mib << 20) // world
    g = torch.Generator().manual_seed(rank)
    tensors = {
        f"t{i}": torch.randn(per_rank // _N_TENSORS // 4, generator=g) for i in range(_N_TENSORS)
    }
    node = os.path.join(args.dir, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    manager = LocalCheckpointManager(node, "f2", repl)

    def max_over_ranks(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    saves = []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(CpuStateDict(dict(tensors)), i + 1)
        saves.append(max_over_ranks(time.perf_counter() - t0))
    kept = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(node) for f in fs) / sum(
        t.numel() * 4 for t in tensors.values()
    )
    kept = max_over_ranks(kept)

    def load() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fresh = LocalCheckpointManager(node, "f2", repl)
        fresh.find_latest()
        state, _ = fresh.load()
        took = max_over_ranks(time.perf_counter() - t0)
        assert torch.equal(state.state_dict["t0"], tensors["t0"])
        return took

    warm = load()  # right after its saves: the files are in the page cache (no fsync)
    dist.barrier()
    if rank == 0:  # as bench_local's loads: page cache dropped (needs root; else warm)
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass
    cold = load()
    dist.barrier()
    if rank == 0:
        queue.put(
            {
                "nvrx f2 s": statistics.median(saves),
                "nvrx load s": warm,
                "nvrx load cold s": cold,
                "nvrx bytes kept / state": kept,
                "nvrx all": saves,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_nvrx")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    shutil.rmtree(args.dir, ignore_errors=True)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        args=(args.world_size, args, _free_port(), queue),
        nprocs=args.world_size,
        join=True,
        start_method="spawn",
    )
    result = queue.get()
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
