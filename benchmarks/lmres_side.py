"""lm-resiliency (GEMINI in-memory checkpoints) on CPU, for `bench_local`'s parity phase.

Run it in a Python that has lm-resiliency 0.2 and torch (it never imports dist_checkpointing):

    "$LMRES_VENV/bin/python" benchmarks/lmres_side.py --world-size 4 --mib-per-rank 256

What runs, through lm-resiliency's public entry point only (`enable_resiliency(model,
optimizer, ...)` with `InMemoryCkptConfig`; SCOUT detection off; replication jump 1, so rank
r pairs with r ^ 1, one rank per "node" as in our parity phase; `verify_integrity=True`, as
ours checks every part it loads):
- each rank holds `--mib-per-rank` MiB of fp32 state in 8 tensors, as ours: a model of 4
  parameters and SGD's 4 momentum buffers of the same size;
- save: `optimizer.step()` (no gradients, so the step itself does nothing) runs
  lm-resiliency's post-step hook, which captures the state into its host buffers (on a CPU
  the copy is synchronous) and starts the peer exchange in background threads. `blocks` is
  how long `optimizer.step()` took; `replicated` is until `finalize_replication()` (of the
  handle's `ckpt_manager`) returns with the peer's replica received. Two untimed captures
  first (its buffers are allocated and touched lazily), then `--repeats` timed ones, each
  after an untimed change of one element per tensor (a stale copy would then be noticed);
- host memory kept: resident memory (VmRSS) grown from before `enable_resiliency` to after
  the last timed save, over the state's bytes (its 2 own + 2 peer slots);
- in-memory rollback (live processes): `ckpt_manager.load()` of the latest step;
- a lost node (`--lost-rank`, default the last): its node directory is deleted and it
  flushes nothing. The survivors run `flush_for_restart()` (what its SIGTERM handler runs
  before a restart: own and peer slots, written and fsync'd to node-local disk), and the
  lost rank's peer runs `copy_checkpoint_to(<the lost node's directory>)` (its replacement
  workflow: the files are copied; on a real cluster this leg crosses the network, which
  lm-resiliency leaves to the launcher). Both `--repeats` times, from empty directories;
- the restarted job: every rank builds the model and a fresh optimizer and calls
  `enable_resiliency(...)`, which loads the latest step at start (the lost rank from what its
  peer copied to its directory), after the page cache is dropped (needs root); one untimed
  load, then `--repeats` timed ones. Simulated in the same processes (one world, not two):
  the saving handle is closed and its buffers freed first, so the new handle holds nothing in
  memory and can only load from node-local disk;
- every load (rollback and restart) is checked bit for bit against SHA-256 digests of the
  state at the last save, and the restored step against the last saved step.

Times are the max over ranks, medians over the repeats. Prints one JSON line whose keys start
with `lmres `; `"lmres skipped"` (and nothing else) when the host lacks the memory the run
needs (`--mib-per-rank` x about 6.5 per rank: the state, 4 slots, and the clones its flush
and rollback make).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import time
from typing import Any, Dict, List, Tuple

_N_PARAMS = 4  # and as many momentum buffers: 8 tensors, as ours
#: host memory per rank as a multiple of the state (state, 4 slots, a clone) and its base
_RAM_FACTOR, _RAM_BASE_GIB = 6.5, 0.4
_WARM_UP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _drop_page_cache() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:  # not root: the loads read from the page cache
        pass


def _init(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=30),
    )


def _model(numel: int, fill: bool, rank: int) -> Tuple[Any, Any]:
    """A model of `_N_PARAMS` parameters and SGD with momentum (buffers made when `fill`)."""
    import torch

    g = torch.Generator().manual_seed(rank)
    model = torch.nn.Module()
    for i in range(_N_PARAMS):
        data = torch.randn(numel, generator=g) if fill else torch.zeros(numel)
        model.register_parameter(f"w{i}", torch.nn.Parameter(data))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _tensors(params: List[Any], optimizer_state: Dict[Any, Any]) -> List[Any]:
    """The state's 8 tensors in a fixed order: parameters, then momentum buffers."""
    return params + [optimizer_state[i]["momentum_buffer"] for i in range(len(params))]


def _state_tensors(model: Any, optimizer: Any) -> List[Any]:
    params = [p.detach() for p in model.parameters()]
    return _tensors(params, optimizer.state_dict()["state"])


def _digests(tensors: List[Any]) -> List[str]:
    import torch

    return [
        hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for t in tensors
    ]


def _config(args: argparse.Namespace, rank: int) -> Any:
    from lm_resiliency import InMemoryCkptConfig

    return InMemoryCkptConfig(
        replication_jump=1,  # one rank per node: rank r pairs with r ^ 1
        disk_flush_interval=0,  # node-local files come from the restart flush only
        disk_folder=os.path.join(args.dir, f"node{rank}"),
        run_id="bench-local-parity",
        verify_integrity=True,
        pin_memory=False,
    )


def _enable(model: Any, optimizer: Any, args: argparse.Namespace, rank: int) -> Any:
    import torch
    import torch.distributed as dist
    from lm_resiliency import enable_resiliency

    return enable_resiliency(
        model,
        optimizer,
        interval=1,
        enable_detection=False,
        checkpoint=_config(args, rank),
        # with no group, it would discover peer groups and make NCCL ones (CPU only here)
        group=dist.group.WORLD,
        device=torch.device("cpu"),
        recovery_mode="latest",
    )


def _max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    """Captures, the in-memory rollback, a restart's flush and copy, the restarted job's loads."""
    import gc

    import torch
    import torch.distributed as dist

    _init(rank, world, port)
    numel = (args.mib_per_rank << 20) // (2 * _N_PARAMS) // 4
    model, optimizer = _model(numel, fill=True, rank=rank)
    g = torch.Generator().manual_seed(1000 + rank)
    for p in model.parameters():
        p.grad = torch.randn(numel, generator=g)
    rss0 = _rss_bytes()
    handle = _enable(model, optimizer, args, rank)
    manager = handle.ckpt_manager
    optimizer.step()  # the momentum buffers appear (and the first, untimed, capture)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    state = _state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    out: Dict[str, List[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    assert manager.finalize_replication(), "the first capture was not replicated"
    for i in range(_WARM_UP - 1 + args.repeats):
        with torch.no_grad():  # every capture differs from the one before
            for t in state:
                t.view(-1)[i % t.numel()] += 1.0
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.step()
        blocked = time.perf_counter() - t0
        ok = manager.finalize_replication()
        final = time.perf_counter() - t0
        assert _max(0.0 if ok else 1.0) == 0.0, f"capture {i} was not replicated on every rank"
        if i >= _WARM_UP - 1:
            add("lmres save blocks s", _max(blocked))
            add("lmres replicated s", _max(final))
    last_step = handle.step_count
    rss = (_rss_bytes() - rss0) / state_bytes
    want = _digests(state)

    for _ in range(args.repeats):  # live processes roll back to their latest capture
        dist.barrier()
        t0 = time.perf_counter()
        loaded = manager.load(mode="latest")
        took = _max(time.perf_counter() - t0)
        assert loaded is not None and loaded[1] == last_step, loaded and loaded[1]
        sd = loaded[0]
        assert _digests(_tensors(list(sd["model"].values()), sd["optimizer"]["state"])) == want
        add("lmres memory rollback s", took)
        del loaded, sd
        gc.collect()

    lost = args.lost_rank % world
    peer = lost ^ 1
    node = os.path.join(args.dir, f"node{rank}")
    disk: List[float] = []
    for _ in range(args.repeats):  # a restart after the lost node's loss: flush, then copy
        shutil.rmtree(node, ignore_errors=True)
        dist.barrier()
        if rank == 0:
            os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        if rank != lost:
            assert handle.flush_for_restart() == last_step
        add("lmres flush s", _max(time.perf_counter() - t0))
        disk.append(_max(_dir_bytes(node) / state_bytes if rank != lost else 0.0))
        dist.barrier()
        t0 = time.perf_counter()
        if rank == peer:
            assert handle.copy_checkpoint_to(os.path.join(args.dir, f"node{lost}")) == last_step
        add("lmres copy to replacement s", _max(time.perf_counter() - t0))
    handle.close()
    del handle, manager, model, optimizer, state
    gc.collect()
    out["lmres restart load s"] = _restart(rank, world, args, numel, want, last_step)
    rss = _max(rss)
    peak = _max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)  # KiB
    if rank == 0:
        result: Dict[str, Any] = {k: statistics.median(v) for k, v in out.items()}
        result.update(
            {
                "lmres host RAM kept / state": rss,
                "lmres disk after flush / state": statistics.median(disk),
                "lmres peak RSS GiB per rank (max)": peak,
                "lmres samples": out,
            }
        )
        queue.put(result)
    dist.destroy_process_group()


def _restart(
    rank: int, world: int, args: argparse.Namespace, numel: int, want: List[str], last_step: int
) -> List[float]:
    """The restarted job: every rank (the lost one from what its peer copied to its
    directory) builds the model and a fresh optimizer and loads in `enable_resiliency`.

    Simulated in the same processes: the saving handle is closed and its buffers freed, so
    the new handle holds nothing in memory and loads from node-local disk (the restored
    step and every byte are checked). One untimed load first (imports, groups)."""
    import gc

    import torch
    import torch.distributed as dist

    took: List[float] = []
    for i in range(1 + args.repeats):
        model, optimizer = _model(numel, fill=False, rank=rank)
        dist.barrier()
        if rank == 0:
            _drop_page_cache()
        dist.barrier()
        t0 = time.perf_counter()
        handle = _enable(model, optimizer, args, rank)
        elapsed = _max(time.perf_counter() - t0)
        if i:
            took.append(elapsed)
        step = handle.recovered_step
        with torch.no_grad():
            got = _digests(_state_tensors(model, optimizer)) if step > 0 else []
        handle.close()
        bad = got != want or step != last_step
        assert _max(float(bad)) == 0.0, f"rank {rank}: step {step}, state equal: {not bad}"
        del model, optimizer, handle
        gc.collect()
    return took


def _spawn(fn: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """Runs `fn` on `--world-size` spawned ranks (plain multiprocessing: this process never
    imports torch); a rank that fails ends the others rather than leave them waiting."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=fn, args=(rank, args.world_size, args, port, queue))
        for rank in range(args.world_size)
    ]
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    if failed or queue.empty():
        raise SystemExit(f"lm-resiliency ranks {failed or 'all'} failed (see above)")
    return queue.get()


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """The run (one world); the result `main` prints."""
    from importlib.metadata import version

    if args.world_size % 2:
        raise SystemExit("--world-size must be even (lm-resiliency pairs ranks)")
    need = args.world_size * (args.mib_per_rank / 1024 * _RAM_FACTOR + _RAM_BASE_GIB)
    have = _mem_available_gib()
    if not have >= need + 1:
        return {
            "lmres skipped": f"needs ~{need:.1f} GiB of host memory ({args.world_size} ranks x "
            f"{args.mib_per_rank} MiB x ~{_RAM_FACTOR}: state, 4 slots, a clone), "
            f"{have:.1f} GiB available"
        }
    shutil.rmtree(args.dir, ignore_errors=True)
    saved = _spawn(_worker, args)
    shutil.rmtree(args.dir, ignore_errors=True)
    # a lost node's recovery: the survivors' flush, the copy to its replacement, the load
    # (the sum of the three medians)
    saved["lmres recovery s"] = sum(
        saved[k] for k in ("lmres flush s", "lmres copy to replacement s", "lmres restart load s")
    )
    saved["lmres GB per rank"] = (args.mib_per_rank << 20) / 1e9
    saved["lmres version"] = version("lm-resiliency")
    saved["lmres verified"] = True  # the workers assert every load's step and bytes
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lost-rank", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_lmres")
    args = parser.parse_args()
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
