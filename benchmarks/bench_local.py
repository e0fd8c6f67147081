"""Local checkpoints against our global checkpoint, torch.save and nvidia-resiliency-ext.

Each rank holds `--total-mib / world` MiB of fp32 tensors and writes to its own "node"
directory. In one run, per world size, medians over `--repeats` rounds (at least 3; each
sample is the max over ranks). The rows alternate within each round (every row measured
once per round), so the machine's drift hits them alike; the JSON keeps every sample, the
CPU seconds (user + system, max over ranks) of each, and the load average before and after.
The save rows rotate their order from round to round, each after an untimed `sync`:
- `torch.save` + fsync per rank (a baseline);
- our `torch_dist` sync save, its load (page cache dropped), and async save: how long
  `save()` + `schedule_async_request` block the caller and when the save is committed;
- local saves (LocalCheckpointManager) without replication and with replication factor 2
  (jump 1), synchronous;
- local load (a fresh manager's find_latest + load, page cache dropped; it and the
  `torch_dist` load take turns going first) and recovery after one rank's directory is
  lost (its part comes from its replica holder; the directory is moved aside and put back
  afterwards, so later saves still find their spares);
- every timed local save writes over the parts its predecessor superseded (recycled), as
  every save of a training run after the first does: two untimed saves per manager come
  first (and one untimed load of each kind: the read-path probe, threads);
- local async save (factor 2): blocking time and commit time; one untimed warm-up async
  save of each kind (ours torch_dist and local) comes first, so one-time costs (pools,
  threads) are not counted, and the timed saves of the two kinds alternate;
- with `--nvrx-python PY` (a Python with nvidia-resiliency-ext 0.4.1 and torch, e.g. a side
  venv; `--nvrx-path DIR` puts DIR on its PYTHONPATH, e.g. `/work/main/.mcore19/site` with
  0.7.0 beside the megatron-core 0.19 venv): its LocalCheckpointManager with replication factor 2, run by
  `benchmarks/nvrx_local_side.py` in that interpreter, in the same run (our package never
  imports it); its load is one cold sample in its own world (`benchmarks/local_load_ab.py`
  compares the two loads sample by sample, in one world);
- `--phases parity` (not in the default): parity replication against clique factor 2 on
  `--parity-world` ranks, `--parity-mib` MiB per rank (`benchmarks/_local_parity.py`), with
  nvidia-resiliency-ext's factor 2 at the same size when `--nvrx-python` is given, and
  lm-resiliency (GEMINI's in-memory copies, `benchmarks/lmres_side.py` run in
  `--lmres-python`) on the same ranks and repeats, in a second table
  (`benchmarks/_local_lmres.py`), at `--lmres-mib` MiB per rank (default `--parity-mib`).

The table gives the ratios that matter next to each row.

    python -m benchmarks.bench_local --world-sizes 2 4 --total-mib 1024 --nvrx-python "$NVRX_VENV/bin/python"
    python -m benchmarks.bench_local --phases parity --parity-world 4 --parity-k 4 --parity-mib 1024 \
        --lmres-python "$LMRES_VENV/bin/python" --lmres-mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks._common import (
    drop_page_cache,
    init_world,
    max_over_ranks,
    median,
    print_table,
    rotated,
    run_world,
    write_json,
)

_N_TENSORS = 8
#: iterations of the untimed local saves before the timed ones (see `_worker`)
_WARM_UP = (1, 2)


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all its threads, so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class _Samples:
    """Per-row samples: wall seconds (max over ranks) and CPU seconds (max over ranks)."""

    def __init__(self) -> None:
        self.wall: Dict[str, List[float]] = {}
        self.cpu: Dict[str, List[float]] = {}

    def timed(self, key: str, fn: Callable[[], Any]) -> None:
        """Collective: times `fn` from a barrier until the slowest rank finished it."""
        dist.barrier()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        self.add(key, max_over_ranks(wall), max_over_ranks(cpu))

    def add(self, key: str, wall: float, cpu: float = float("nan")) -> None:
        self.wall.setdefault(key, []).append(wall)
        self.cpu.setdefault(key, []).append(cpu)

    def results(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {k: median(v) for k, v in self.wall.items()}
        out["samples"] = {k: [round(x, 3) for x in v] for k, v in self.wall.items()}
        out["cpu s per rank (max)"] = {
            k: [round(x, 2) for x in v] for k, v in self.cpu.items() if all(x == x for x in v)
        }
        return out


def _drop_cache(rank: int) -> None:
    dist.barrier()
    if rank == 0:
        drop_page_cache()
    dist.barrier()


def _settle(rank: int) -> None:
    """Collective: writes back every dirty page (untimed), so the next row starts alike."""
    dist.barrier()
    if rank == 0:
        os.sync()
    dist.barrier()


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    per_rank = (args.total_mib << 20) // world
    g = torch.Generator().manual_seed(rank)
    tensors = {
        f"t{i}": torch.randn(per_rank // _N_TENSORS // 4, generator=g) for i in range(_N_TENSORS)
    }
    root = os.path.join(args.dir, f"w{world}")
    node = os.path.join(root, f"node{rank}")
    shared = os.path.join(root, "global")
    os.makedirs(node, exist_ok=True)
    repl = CliqueReplicationStrategy.from_replication_params(1, 2)
    s = _Samples()
    reps = range(args.repeats)

    def sharded(fill: bool = True) -> Dict[str, Any]:
        return {
            k: ShardedTensor.from_rank_offsets(
                k, t if fill else torch.empty_like(t), (0, rank, world)
            )
            for k, t in tensors.items()
        }

    def torch_save(i: int) -> None:
        path = os.path.join(node, f"torch_{i}.pt")
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)

    def remove_global(ckpt: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt)
        dist.barrier()

    def state() -> Any:
        return BasicTensorAwareStateDict(dict(tensors))

    managers = {f: LocalCheckpointManager(node, f"f{f}", repl if f == 2 else None) for f in (1, 2)}

    loaded: List[Any] = []

    def load_local() -> None:
        fresh = LocalCheckpointManager(node, "f2", repl)
        fresh.find_latest()
        loaded.append(fresh.load()[0])

    def check_local() -> None:  # outside the timed region, as for torch_dist
        state = loaded.pop()
        for k, t in tensors.items():
            assert torch.equal(state.state_dict[k], t), k

    saves, loads = "saves" in args.phases, "loads" in args.phases
    # a warm-up round first (untimed): one-time costs (pools, probes, threads) of every
    # kind of save are paid before the timed rounds
    # Two local saves per manager: the second recycles the first's parts, as every save of
    # a training run after its first does, so each timed save writes over spares.
    # With loads, one untimed load of each kind too (the read-path probe, reader threads),
    # which the first timed load of either kind would otherwise pay alone.
    if saves or loads:
        dc.save(sharded(), os.path.join(shared, "warm-up"))
        if loads:
            dc.load(sharded(fill=False), os.path.join(shared, "warm-up"))
        remove_global(os.path.join(shared, "warm-up"))
        for m in managers.values():
            for it in _WARM_UP:
                m.save(state(), it)
        if loads:
            load_local()
            check_local()
    # Every row is measured once per round, rows alternating within a round, so that the
    # machine's drift (other users, the disk's state) hits every row alike.
    for i in reps if saves or loads else ():
        ckpt = os.path.join(shared, f"sync_{i}")
        rows: List[Tuple[str, Callable[[], Any]]] = []
        if saves:
            rows.append(("torch.save s", lambda: torch_save(i)))
        rows.append(("torch_dist save s", lambda: dc.save(sharded(), ckpt)))
        for f, m in managers.items():
            if saves or f == 2:
                it = i + len(_WARM_UP) + 1
                rows.append((f"local f{f} s", lambda m=m, it=it: m.save(state(), it)))
        # The save rows take turns going first (a fixed order had the local save always
        # right after `torch_dist`'s), and each starts with the disk settled (an untimed
        # sync): no row pays for the writeback an earlier row left behind (the replicated
        # save's own part is not fsync'd by policy, so its writeback comes after it).
        for key, fn in rotated(rows, i):
            _settle(rank)
            s.timed(key, fn)
        if loads:
            # the two loads of the same bytes take turns going first
            for kind in ("torch_dist", "local") if i % 2 == 0 else ("local", "torch_dist"):
                _drop_cache(rank)
                if kind == "torch_dist":
                    request = sharded(fill=False)
                    s.timed("torch_dist load s", lambda: dc.load(request, ckpt))
                    for k, t in tensors.items():
                        assert torch.equal(request[k].data, t), k
                else:
                    s.timed("local load s", load_local)
                    check_local()
            # the last rank loses its directory: moved aside (not deleted) and put back
            # after the recovery, so the next round's saves still write over spares
            lost, aside = os.path.join(node, "f2"), os.path.join(node, "f2.lost")
            dist.barrier()
            if rank == world - 1:
                os.rename(lost, aside)
            _drop_cache(rank)
            s.timed("recovery s", load_local)
            check_local()
            dist.barrier()
            if rank == world - 1:
                shutil.rmtree(lost, ignore_errors=True)
                os.rename(aside, lost)
        remove_global(ckpt)

    # the sync sessions' files are not needed any more (disk space)
    dist.barrier()
    for f in managers:
        shutil.rmtree(os.path.join(node, f"f{f}"), ignore_errors=True)
    # async saves: warm-up saves first (one-time costs: pools, groups, threads; two local
    # ones, so that the timed ones write over spares), then the timed saves, alternating
    q = AsyncCallsQueue()
    m_async = LocalCheckpointManager(node, "async", repl)

    def async_save(kind: str, i: int, timed: bool) -> None:
        ckpt = os.path.join(shared, f"async_{i}")
        dist.barrier()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        if kind == "torch_dist":
            request = dc.save(sharded(), ckpt, async_sharded_save=True)
        else:
            request = m_async.save(state(), i + 1, is_async=True)
        q.schedule_async_request(request)
        blocked = max_over_ranks(time.perf_counter() - t0)
        q.maybe_finalize_async_calls(blocking=True)
        final = max_over_ranks(time.perf_counter() - t0)
        cpu = max_over_ranks(_cpu_seconds() - c0)
        if timed:
            s.add(f"{kind} async blocks s", blocked)
            s.add(f"{kind} async final s", final, cpu)
        if kind == "torch_dist":
            remove_global(ckpt)

    for kind in ("torch_dist", "local") if "async" in args.phases else ():
        for i in range(len(_WARM_UP) if kind == "local" else 1):
            async_save(kind, i, timed=False)
    for i in reps if "async" in args.phases else ():
        for kind in ("torch_dist", "local"):
            async_save(kind, i + len(_WARM_UP), timed=True)
    q.close()
    out = s.results()
    out["GB per rank"] = sum(t.numel() * 4 for t in tensors.values()) / 1e9
    dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _nvrx(args: argparse.Namespace, world: int) -> Dict[str, Any]:
    """Runs nvidia-resiliency-ext's local manager in `--nvrx-python` (a separate process)."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [
        args.nvrx_python,
        os.path.join(here, "nvrx_local_side.py"),
        "--world-size",
        str(world),
        "--total-mib",
        str(args.total_mib),
        "--repeats",
        str(args.repeats),
        "--dir",
        os.path.join(args.dir, f"nvrx_w{world}"),
    ]
    env = dict(os.environ)
    if args.nvrx_path:  # where nvidia-resiliency-ext lies (e.g. unpacked wheels), not ours
        env["PYTHONPATH"] = args.nvrx_path
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd="/", env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_ROWS = [
    ("torch.save s", "torch.save + fsync per rank", None),
    ("torch_dist save s", "ours torch_dist sync save", None),
    ("torch_dist load s", "ours torch_dist load", None),
    ("torch_dist async blocks s", "ours torch_dist async: save() blocks", None),
    ("torch_dist async final s", "ours torch_dist async: committed", None),
    ("local f1 s", "local save, no replication", ("torch_dist save s", "<= 0.8")),
    ("local f2 s", "local save, replication factor 2", ("local f1 s", "<= 1.3")),
    ("local load s", "local load", ("torch_dist load s", "<= 0.8")),
    ("recovery s", "recovery after losing a rank's dir", ("local load s", "<= 1.5")),
    (
        "local async blocks s",
        "local async f2: save() blocks",
        ("torch_dist async blocks s", "<= 1"),
    ),
    ("local async final s", "local async f2: committed", None),
    ("nvrx f2 s", "nvidia-resiliency-ext 0.4.1 local, factor 2", None),
]


def _table(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    if "nvrx f2 s" in res:
        res["ours f2 / nvrx f2"] = res["local f2 s"] / res["nvrx f2 s"]
    for key, what, target in _ROWS:
        if key not in res:
            continue
        row: Dict[str, Any] = {
            "what": what,
            "s": res[key],
            "x torch.save": res[key] / res["torch.save s"] if "torch.save s" in res else "",
        }
        if target is not None and target[0] in res:
            row["ratio"] = (
                f"{res[key] / res[target[0]]:.2f} x {target[0].removesuffix(' s')} (goal {target[1]})"
            )
        rows.append(row)
    if "nvrx f2 s" in res:
        rows.append(
            {
                "what": "ours f2 / nvrx f2",
                "s": "",
                "x torch.save": "",
                "ratio": f"{res['ours f2 / nvrx f2']:.2f} (goal <= 0.6)",
            }
        )
    return rows


def _parity(args: argparse.Namespace) -> Dict[str, Any]:
    """The parity phase (see `benchmarks/_local_parity.py`): table printed, results returned."""
    from benchmarks._local_parity import parity_table, parity_worker

    shutil.rmtree(args.dir, ignore_errors=True)
    before = os.getloadavg()
    res = run_world(parity_worker, args.parity_world, args)
    if args.nvrx_python:
        total = argparse.Namespace(
            **{**vars(args), "total_mib": args.parity_mib * args.parity_world}
        )
        res.update(_nvrx(total, args.parity_world))
    if args.lmres_python:
        from benchmarks._local_lmres import run_lmres

        res.update(run_lmres(args))
    shutil.rmtree(args.dir, ignore_errors=True)
    after = os.getloadavg()
    res["load average before"], res["load average after"] = before, after
    print_table(
        f"parity k={args.parity_k} vs clique f2, {args.parity_world} ranks, {args.parity_mib} MiB "
        f"fp32 per rank, medians of {args.repeats}; load average before {_loads(before)}, "
        f"after {_loads(after)}",
        parity_table(res, args.parity_k),
        ["what", "clique f2", f"parity k{args.parity_k}", "parity / clique"],
    )
    if args.lmres_python:
        from benchmarks._local_lmres import lmres_table, lmres_title

        print_table(
            lmres_title(res, args),
            lmres_table(res, args.parity_k, args.parity_mib),
            ["what", "lm-resiliency", "clique f2", f"parity k{args.parity_k}"]
            + ["parity / lm-res", "note"],
        )
    print(json.dumps(res, indent=1))
    sys.stdout.flush()
    return res


def _loads(avg: Any) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_local")
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=["saves", "loads", "async", "parity"],
        default=["saves", "loads", "async"],
        help="what to measure (default all; loads also time the saves they load)",
    )
    parser.add_argument(
        "--nvrx-python",
        default=os.environ.get("DIST_CKPT_NVRX_PYTHON", ""),
        help="Python with nvidia-resiliency-ext 0.4.1 (default $DIST_CKPT_NVRX_PYTHON; empty: skip)",
    )
    parser.add_argument(
        "--nvrx-path",
        default=os.environ.get("DIST_CKPT_MCORE19_PATH", ""),
        help="PYTHONPATH of --nvrx-python (default $DIST_CKPT_MCORE19_PATH: the folder with "
        "nvidia-resiliency-ext 0.7.0 unpacked; empty: its own site-packages)",
    )
    parser.add_argument("--parity-world", type=int, default=4)
    parser.add_argument("--parity-k", type=int, default=4, help="parity group size")
    parser.add_argument("--parity-mib", type=int, default=1024, help="state per rank (MiB)")
    parser.add_argument(
        "--lmres-python",
        default=os.environ.get("DIST_CKPT_LMRES_PYTHON", ""),
        help="Python with lm-resiliency 0.2 and torch, for the parity phase (default "
        "$DIST_CKPT_LMRES_PYTHON; empty: skip)",
    )
    parser.add_argument(
        "--lmres-mib",
        type=int,
        default=0,
        help="lm-resiliency's state per rank (MiB; default --parity-mib): it needs ~6x "
        "that in host memory per rank",
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    for name in ("nvrx_python", "nvrx_path", "lmres_python"):  # the side runs start in /
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if args.repeats < 3:
        print(f"--repeats {args.repeats}: taking 3, the fewest a median means anything with")
        args.repeats = 3
    results: Dict[str, Any] = {}
    if "parity" in args.phases:
        results["parity"] = _parity(args)
    for world in args.world_sizes if set(args.phases) - {"parity"} else ():
        shutil.rmtree(args.dir, ignore_errors=True)
        before = os.getloadavg()
        res = run_world(_worker, world, args)
        if args.nvrx_python and "saves" in args.phases:
            res.update(_nvrx(args, world))
        shutil.rmtree(args.dir, ignore_errors=True)
        after = os.getloadavg()
        res["load average before"], res["load average after"] = before, after
        results[str(world)] = res
        print_table(
            f"local checkpoints, {world} ranks, {args.total_mib} MiB fp32 in all, medians of "
            f"{args.repeats}; load average (1/5/15 min) before {_loads(before)}, after {_loads(after)}",
            _table(res),
            ["what", "s", "x torch.save", "ratio"],
        )
        print(json.dumps(res, indent=1))
        sys.stdout.flush()
    if args.json:
        write_json(
            args.json,
            {"raw": results, "rows": {w: _table(r) for w, r in results.items() if w != "parity"}},
        )


if __name__ == "__main__":
    main()
