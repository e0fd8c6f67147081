"""Fully parallel save and load of replicated state, against the plain strategies and megatron's.

Every rank holds the same `--total-mib` MiB of fp32 tensors (data-parallel replicas; rank 0's
copy is the main replica). Per world size, medians over `--repeats` (wall time from a barrier
until every rank finished; page cache dropped before loads when possible; the order of the
methods alternates between repeats; `--methods` picks them):
- plain: `TorchDistSaveShardedStrategy` (rank 0 writes everything) and
  `TorchDistLoadShardedStrategy` (every rank reads everything);
- ours, fully parallel: `FullyParallelSaveStrategyWrapper` / `FullyParallelLoadStrategyWrapper`
  around them (each tensor written once and read once in the group, then exchanged);
- megatron-core's own wrappers and torch_dist strategies, when megatron-core is importable
  in this interpreter (its CPU load exchange needs `exchange_algo="gather_object"`).

Run it with a python that has megatron-core and this repository on the path to get all three:

    PYTHONPATH=. .venv-mcore/bin/python -m benchmarks.bench_fully_parallel --world-sizes 2 4
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from typing import Any, Dict, List

import torch

from benchmarks._common import (
    drop_page_cache,
    init_world,
    median,
    print_table,
    run_world,
    timed,
    write_json,
)

METHODS = ("plain", "ours_fully_parallel", "megatron_fully_parallel")


def _state(mod: Any, rank: int, total_mib: int, n: int, load: bool) -> Dict[str, Any]:
    rows = total_mib * 2**20 // 4 // n // 1024
    out = {}
    for i in range(n):
        data = torch.zeros(rows, 1024) if load else torch.full((rows, 1024), float(i))
        out[f"t{i}"] = mod.ShardedTensor.from_rank_offsets(f"t{i}", data, replica_id=rank)
    return out


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    import torch.distributed as dist

    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing.strategies import fully_parallel as fp
    from dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    methods = [m for m in args.methods if m != "megatron_fully_parallel" or args.with_megatron]
    if "megatron_fully_parallel" in methods:
        # megatron-core calls these on CPU paths; patched in this benchmark process only
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        from megatron.core import dist_checkpointing as mdc
        from megatron.core.dist_checkpointing.strategies import fully_parallel as mfp
        from megatron.core.dist_checkpointing.strategies import torch as mtorch
    times: Dict[str, Dict[str, List[float]]] = {m: {"save": [], "load": []} for m in methods}
    for rep in range(args.repeats):
        # alternate the order (A/B, then B/A) so that drifting machine load favours no method
        for method in methods if rep % 2 == 0 else methods[::-1]:
            ckpt = os.path.join(args.dir, f"{method}_{world}_{rep}")
            if rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
                os.makedirs(ckpt)
            dist.barrier()
            out: Dict[str, Any] = {}
            if method == "megatron_fully_parallel":
                sd = _state(mdc, rank, args.total_mib, args.tensors, False)
                save_s = mfp.FullyParallelSaveStrategyWrapper(
                    mtorch.TorchDistSaveShardedStrategy("torch_dist", 1)
                )
                t_save = timed(lambda: mdc.save(sd, ckpt, save_s))
                req = _state(mdc, rank, args.total_mib, args.tensors, True)
                load_s = mfp.FullyParallelLoadStrategyWrapper(
                    mtorch.TorchDistLoadShardedStrategy(), exchange_algo="gather_object"
                )
                if rank == 0:
                    drop_page_cache()
                t_load = timed(lambda: out.update(mdc.load(req, ckpt, load_s)))
            else:
                sd = _state(dc, rank, args.total_mib, args.tensors, False)
                save_o: Any = TorchDistSaveShardedStrategy()
                load_o: Any = TorchDistLoadShardedStrategy()
                if method == "ours_fully_parallel":
                    save_o = fp.FullyParallelSaveStrategyWrapper(save_o)
                    load_o = fp.FullyParallelLoadStrategyWrapper(load_o)
                t_save = timed(lambda: dc.save(sd, ckpt, save_o))
                req = _state(dc, rank, args.total_mib, args.tensors, True)
                if rank == 0:
                    drop_page_cache()
                t_load = timed(lambda: out.update(dc.load(req, ckpt, load_o)))
            ok = all(bool((out[f"t{i}"] == float(i)).all()) for i in range(args.tensors))
            if not ok:
                raise RuntimeError(f"{method}: loaded values differ on rank {rank}")
            times[method]["save"].append(t_save)
            times[method]["load"].append(t_load)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
    if rank == 0:
        queue.put({m: {k: median(v) for k, v in t.items()} for m, t in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="bench_out/fully_parallel")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help="methods to run (megatron's only where megatron-core is importable); plain is "
        "always run, as the baseline of the ratios",
    )
    args = parser.parse_args()
    args.with_megatron = importlib.util.find_spec("megatron") is not None
    args.methods = ["plain", *(m for m in args.methods if m != "plain")]
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    for world in args.world_sizes:
        result = run_world(_worker, world, args)
        plain = result["plain"]
        for method, t in result.items():
            rows.append(
                {
                    "world": world,
                    "method": method,
                    "save_s": t["save"],
                    "load_s": t["load"],
                    "save_vs_plain": plain["save"] / t["save"],
                    "load_vs_plain": plain["load"] / t["load"],
                }
            )
    print_table(
        f"Replicated state, {args.total_mib} MiB on every rank, medians of {args.repeats} "
        "(vs_plain > 1: faster than the plain strategy)",
        rows,
        ["world", "method", "save_s", "load_s", "save_vs_plain", "load_vs_plain"],
    )
    if args.json:
        write_json(args.json, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
