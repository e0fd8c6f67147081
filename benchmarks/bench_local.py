"""Local checkpoints: save time with and without replication, caller blocking, recovery time.

Each rank holds `--total-mib / world` MiB of fp32 tensors and writes to its own "node"
directory. Per configuration, medians over `--repeats` saves (max over ranks):
- torch.save: each rank `torch.save`s its tensors to its directory and fsyncs the file
  (our saves fsync too);
- local, replication_factor 1 and 2 (jump 1), synchronous;
- local async (factor 2): how long `save()` blocks the caller, and when the save is final;
- recovery: one rank's directory is deleted; time for a fresh manager's find_latest + load
  on every rank (the lost part comes from its replica holder).

    python -m benchmarks.bench_local --world-size 4 --total-mib 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from benchmarks._common import (
    drop_page_cache,
    init_world,
    max_over_ranks,
    median,
    print_table,
    run_world,
    write_json,
)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    per_rank = (args.total_mib << 20) // world
    n = 8
    tensors = {f"t{i}": torch.randn(per_rank // n // 4) for i in range(n)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    node = os.path.join(args.dir, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    repl = CliqueReplicationStrategy.from_replication_params(1, 2)
    out: Dict[str, Any] = {"GB per rank": nbytes / 1e9}

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return max_over_ranks(time.perf_counter() - t0)

    def torch_save(i: int) -> None:
        path = os.path.join(node, f"torch_{i}.pt")
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)

    out["torch.save s"] = median([timed(lambda i=i: torch_save(i)) for i in range(args.repeats)])
    for factor, strategy in ((1, None), (2, repl)):
        m = LocalCheckpointManager(node, f"f{factor}", strategy)
        times = [
            timed(lambda i=i: m.save(BasicTensorAwareStateDict(dict(tensors)), i + 1))
            for i in range(args.repeats)
        ]
        out[f"local f{factor} s"] = median(times)
    q = AsyncCallsQueue()
    m = LocalCheckpointManager(node, "async", repl)
    blocked, final = [], []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        q.schedule_async_request(
            m.save(BasicTensorAwareStateDict(dict(tensors)), i + 1, is_async=True)
        )
        blocked.append(max_over_ranks(time.perf_counter() - t0))
        q.maybe_finalize_async_calls(blocking=True)
        final.append(max_over_ranks(time.perf_counter() - t0))
    q.close()
    out["async blocks s"] = median(blocked)
    out["async final s"] = median(final)
    recoveries = []
    for i in range(args.repeats):
        dist.barrier()
        if rank == world - 1:
            shutil.rmtree(os.path.join(node, "f2"))
        if rank == 0:
            drop_page_cache()
        dist.barrier()

        def recover() -> None:
            fresh = LocalCheckpointManager(node, "f2", repl)
            fresh.find_latest()
            state, _ = fresh.load()
            assert torch.equal(state.state_dict["t0"], tensors["t0"])

        recoveries.append(timed(recover))
        # restore the lost copy for the next round
        m2 = LocalCheckpointManager(node, "f2", repl)
        m2.save(BasicTensorAwareStateDict(dict(tensors)), 100 + i)
    out["recovery s"] = median(recoveries)
    dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_local")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    res = run_world(_worker, args.world_size, args)
    shutil.rmtree(args.dir, ignore_errors=True)
    base = res["torch.save s"]
    labels = {
        "torch.save s": "torch.save + fsync per rank",
        "local f1 s": "local, no replication",
        "local f2 s": "local, replication_factor 2",
        "async blocks s": "local async f2: save() blocks",
        "async final s": "local async f2: final",
        "recovery s": "recovery after losing a rank's dir",
    }
    rows: List[Dict[str, Any]] = [
        {"what": what, "s": res[key], "x torch.save": res[key] / base}
        for key, what in labels.items()
    ]
    print_table(
        f"local checkpoints, {args.world_size} ranks, {args.total_mib} MiB fp32 in all, medians of {args.repeats}",
        rows,
        ["what", "s", "x torch.save"],
    )
    print(json.dumps(res, indent=1))
    if args.json:
        write_json(args.json, {"rows": rows, "raw": res})


if __name__ == "__main__":
    main()
