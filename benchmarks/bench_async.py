"""Async save: how long the training loop is blocked, against the copy and the sync save.

For each world size (one run of this script covers all of them) and each async caller
(a forked process per save, or one persistent worker):
- `copy s`: `copy_` of this rank's tensors into preallocated host buffers (the floor);
- `sync save s`: `dist_checkpointing.save` without async;
- `blocking s`: time `save(..., async_sharded_save=True)` + `schedule_async_request` take;
- `finalized s`: from the call to save() until the request is finalized (committed);
- `train rate`: steps/s of a data-parallel training loop (16 matmuls of 512x512 and an
  all-reduce of a 1 MiB gradient per step, then the queue poll) while a save is in flight,
  as a fraction of its rate without checkpointing (where the poll's place is taken by an
  equally small collective).
Times are the max over ranks of each save; medians over the 2nd and later saves.

    python -m benchmarks.bench_async --world-sizes 2 4 --total-mib 1024
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
    init_world,
    local_piece,
    max_over_ranks,
    median,
    model_shapes,
    print_table,
    run_world,
    write_json,
)


def _state(shapes: List[tuple], rank: int, world: int, step: int) -> Dict[str, Any]:
    from dist_checkpointing import ShardedTensor

    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"t{i}", local_piece(i, s, rank, world, 0) + step, (0, rank, world)
        )
        for i, s in enumerate(shapes)
    } | {"step": step}


_GRAD = torch.zeros(256 * 1024)


def _train_steps(a: torch.Tensor, seconds: float, matmuls: int, poll: Any = None) -> float:
    """Runs data-parallel training steps: `matmuls` matmuls, an all-reduce of a 1 MiB
    "gradient" (as every data-parallel step does), then one more small collective: the
    queue poll a real loop makes while a save is in flight, or, without a save, the
    agreement to stop after `seconds` (so every rank runs the same number of steps).

    Returns steps/s.
    """
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(matmuls):
            a = torch.tanh(a @ a)
        dist.all_reduce(_GRAD)
        steps += 1
        if poll is not None:
            if poll():
                break
        else:
            flag = torch.tensor([time.perf_counter() - start >= seconds], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
    return steps / (time.perf_counter() - start)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing.serialization import get_default_save_sharded_strategy
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    get_default_save_sharded_strategy()
    shapes = model_shapes(args.total_mib << 20, world)
    root = os.path.join(args.dir, f"w{world}")
    sd = _state(shapes, rank, world, 0)
    tensors = [v.data for v in sd.values() if hasattr(v, "data")]
    bufs = [torch.empty_like(t) for t in tensors]
    copies = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        copies.append(max_over_ranks(time.perf_counter() - t0))
    del bufs
    syncs = []
    for i in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        dc.save(_state(shapes, rank, world, i), os.path.join(root, f"sync_{i}"))
        syncs.append(max_over_ranks(time.perf_counter() - t0))
    a = torch.randn(args.matmul, args.matmul) / args.matmul**0.5
    dist.barrier()
    base_rate = max_over_ranks(_train_steps(a, 3.0, args.matmuls))
    out: Dict[str, Any] = {
        "copy s": median(copies),
        "sync save s": median(syncs[1:] or syncs),
        "base steps/s": base_rate,
    }
    for persistent in (False, True):
        name = "persistent" if persistent else "forked"
        q = AsyncCallsQueue(persistent=persistent)
        blocking, finalized, rates = [], [], []
        for i in range(args.saves):
            state = _state(shapes, rank, world, i)
            dist.barrier()
            t0 = time.perf_counter()
            req = dc.save(state, os.path.join(root, f"{name}_{i}"), async_sharded_save=True)
            q.schedule_async_request(req)
            blocked = time.perf_counter() - t0
            done: List[float] = []

            def poll() -> bool:
                if q.maybe_finalize_async_calls(blocking=False):
                    done.append(time.perf_counter() - t0)
                    return True
                return False

            rates.append(-max_over_ranks(-_train_steps(a, 0, args.matmuls, poll)))  # slowest rank
            blocking.append(max_over_ranks(blocked))
            finalized.append(max_over_ranks(done[0]))
        q.close()
        out[name] = {
            "blocking s": median(blocking[1:]),
            "finalized s": median(finalized[1:]),
            "train rate": median(rates[1:]) / base_rate,
            "all_blocking": blocking,
        }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument(
        "--matmul", type=int, default=512, help="side of the training loop's matmuls"
    )
    parser.add_argument("--matmuls", type=int, default=16, help="matmuls per training step")
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_async")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    rows, raw = [], {}
    for world in args.world_sizes:
        res = run_world(_worker, world, args)
        raw[world] = res
        for caller in ("forked", "persistent"):
            r = res[caller]
            rows.append(
                {
                    "ranks": world,
                    "caller": caller,
                    "copy s": res["copy s"],
                    "sync save s": res["sync save s"],
                    "blocking s": r["blocking s"],
                    "finalized s": r["finalized s"],
                    "blocking/copy": r["blocking s"] / res["copy s"],
                    "blocking/sync": r["blocking s"] / res["sync save s"],
                    "train rate": r["train rate"],
                }
            )
    print_table(
        f"async save, {args.total_mib} MiB fp32 in all, medians of saves 2..{args.saves}",
        rows,
        list(rows[0]),
    )
    print(json.dumps(rows, indent=1))
    if args.json:
        write_json(args.json, {"rows": rows, "raw": raw})


if __name__ == "__main__":
    main()
