"""FSDP2 model + Adam: save, load and load at another world size, against stock DCP and
Meta's torch_checkpointing, every method in one run.

Each world builds the same model (a stack of square `nn.Linear` layers whose width does not
divide by the world size, so last shards are uneven), shards it with `fully_shard` on a
1-D CPU mesh, takes one Adam step (every rank on the same batch, so every world holds the
same global state bit for bit) and saves the whole `get_state_dict(model, optimizer)`
output: parameters, both Adam moments, `step` tensors and `param_groups`. Methods:

- `dcp` / `dcp-async`: `torch.distributed.checkpoint.save` / `async_save` (default stager);
- `tc` / `tc-async`: torch_checkpointing's `CheckpointManager` with its DTensor resharder,
  synchronous / asynchronous saver (skipped, saying so, when it is not installed); it
  writes without fsync, so its files are fsynced before its save time stops;
- `ours` / `ours-async`: `dist_checkpointing.save`, sync / `async_sharded_save` through a
  persistent `AsyncCallsQueue`.

`--device cuda` puts the model on one GPU per rank (NCCL for FSDP2, gloo beside it) and adds
`dcp-async-pinned`: `dcp.async_save` with a pinned-memory `DefaultStager` (reused across
saves where torch allows it, as in bench_gpu).

Async rows report two times: `block`, until the training loop may change its state again
(ours and DCP's default staging: when save returns; DCP's pinned stager: its
`staging_completion`; torch_checkpointing, whose save returns at once and stages in a
thread: when `manager.lock()`, which `optimizer.step()` must hold, can be taken), and
`save`, until the checkpoint is durable and committed. Loads fill the live state dict of a
freshly built model in place with the page cache dropped first, and every loaded tensor is
compared with the expected one (a wrong value fails the run). `load other` reads what the
other world size saved (2 -> 4 and 4 -> 2 when both are run): the worlds run in the order
given, and the first world's loads of the second's checkpoints run in a last pass. Every
method saves and loads once untimed in each world before its timed runs (writer processes,
pools and first-call imports), and the methods take turns going first across repeats.
`--load-repeats K` times each load K times per repeat (loads are short, and this disk's
throughput drifts over seconds: more samples per row than saves).

    python -m benchmarks.bench_dtensor --world-sizes 2 4 --size-mib 1024 --repeats 3
    python -m benchmarks.bench_dtensor --device cuda --world-sizes 1 --size-mib 4096

Only the last repeat's checkpoints are kept on disk (the other world reads those).

torch_checkpointing needs its own venv with our dependencies and this repository on
PYTHONPATH; docs/performance.md gives the set-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._common import (
    drop_page_cache,
    fsync_tree,
    init_world,
    max_over_ranks,
    median,
    print_table,
    rotated,
    run_world,
    write_json,
)

METHODS = ["dcp", "dcp-async", "tc", "tc-async", "ours", "ours-async"]
#: with --device cuda: DCP's async save with a pinned-memory `DefaultStager`
CUDA_METHODS = ["dcp-async-pinned"]
DEVICE = "cpu"
LAYERS = 16


def _width(size_mib: int) -> int:
    """The layer width giving about `size_mib` of parameters plus two Adam moments (fp32),
    made odd so that no world size divides it."""
    params = (size_mib << 20) // 4 // 3
    width = int((params / LAYERS) ** 0.5)
    return width | 1


def _model_and_optimizer(width: int, world: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The benchmark's model after one Adam step, sharded on a 1-D mesh of `world` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    mesh = init_device_mesh(DEVICE, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.ones(2, width, device=DEVICE)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _locals(state: Any, path: str = "") -> Dict[str, torch.Tensor]:
    """Every tensor leaf of `state` as a local tensor, by its path."""
    from torch.distributed.tensor import DTensor

    out: Dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_locals(v, f"{path}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_locals(v, f"{path}/{i}"))
    elif isinstance(state, DTensor):
        out[path] = state.to_local()
    elif isinstance(state, torch.Tensor):
        out[path] = state
    return out


def _scramble(state: Dict[str, Any]) -> None:
    """Overwrites every tensor of a destination state, so a load that skips one is caught."""
    with torch.no_grad():
        for t in _locals(state).values():
            t.fill_(-7)


def _check(loaded: Dict[str, Any], want: Dict[str, torch.Tensor], what: str) -> None:
    got = _locals(loaded)
    if got.keys() != want.keys() or not all(torch.equal(got[k], t) for k, t in want.items()):
        raise RuntimeError(f"{what}: loaded values differ from the saved state")


class _Ours:
    def __init__(self) -> None:
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=True)

    def save(self, state: Dict[str, Any], path: str, is_async: bool) -> float:
        import dist_checkpointing as dc

        if not is_async:
            dc.save(state, path)
            return 0.0
        start = time.perf_counter()
        self.queue.schedule_async_request(dc.save(state, path, async_sharded_save=True))
        blocked = time.perf_counter() - start
        self.queue.maybe_finalize_async_calls(blocking=True)
        return blocked

    def load(self, state: Dict[str, Any], path: str) -> Dict[str, Any]:
        import dist_checkpointing as dc

        out = dc.load(state, path)
        assert isinstance(out, dict)
        return out


class _Dcp:
    def __init__(self) -> None:
        self.stagers: Any = None

    def save(self, state: Dict[str, Any], path: str, is_async: bool, pinned: bool = False) -> float:
        import torch.distributed.checkpoint as dcp

        if not is_async:
            dcp.save(state, checkpoint_id=path)
            return 0.0
        kwargs: Dict[str, Any] = {}
        if pinned:  # bench_gpu's stager handling: reused where torch allows it
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            from benchmarks.bench_gpu import _Stagers, _staging_options

            if self.stagers is None:
                options = _staging_options(StagingOptions, True)
                self.stagers = _Stagers(lambda: DefaultStager(options))
            kwargs["async_stager"] = self.stagers()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path, **kwargs)
        if hasattr(future, "staging_completion"):  # the state may change once it is staged
            future.staging_completion.result()
        blocked = time.perf_counter() - start
        if hasattr(future, "upload_completion"):
            future.upload_completion.result()
        else:
            future.result()
        return blocked

    def close(self) -> None:
        if self.stagers is not None:
            self.stagers.close()

    def load(self, state: Dict[str, Any], path: str) -> Dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=path)
        return state


def _gather_metadata_on_cpu() -> None:
    """torch_checkpointing 0.1.1 all-gathers its resharding metadata through CUDA tensors
    even on a gloo group; on a CPU-only host its save fails without this. The replacement
    gathers the same objects over the group's CPU backend (a few KiB per save)."""
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self: Any, data: Any, process_group: Any = None) -> Dict[int, Any]:
        out: List[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


class _TorchCheckpointing:
    def __init__(self) -> None:
        import torch_checkpointing as tc
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder

        if not torch.cuda.is_available():
            _gather_metadata_on_cpu()
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        spec = tc.ItemSpec(resharder=DefaultResharder())
        # its O_DIRECT writer fails here (EINVAL when the unaligned tail of a file is written)
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        self.sync = tc.CheckpointManager(
            tc.CheckpointManager.Config(
                save=SyncCheckpointSaverConfig(), default=spec, storage_config=storage
            )
        )
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig

        # its writer process starts (importing torch) on the first save: on a loaded host
        # that took more than its default 30 s
        process = CheckpointProcessConfig(subprocess_init_timeout_secs=300)
        self.asynchronous = tc.CheckpointManager(
            tc.CheckpointManager.Config(
                default=spec,
                storage_config=storage,
                save=AsyncCheckpointSaverConfig(process_config=process),
            )
        )

    def save(self, state: Dict[str, Any], path: str, is_async: bool) -> float:
        # it writes without fsync: its files are synced here so that every method's save
        # time ends with a durable checkpoint, as DCP's and ours do
        if not is_async:
            self.sync.save(path, state)
            fsync_tree(path)
            return 0.0
        start = time.perf_counter()
        future = self.asynchronous.save(path, state)
        with self.asynchronous.lock():  # what `optimizer.step()` must hold: taken once
            blocked = time.perf_counter() - start  # the state is staged
        assert future is not None
        future.result()
        fsync_tree(path)
        return blocked

    def load(self, state: Dict[str, Any], path: str) -> Dict[str, Any]:
        return dict(self.sync.load(path, into=state))

    def close(self) -> None:
        self.sync.close()
        self.asynchronous.close()


def _libraries(methods: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    libs: Dict[str, Any] = {}
    if any(m.startswith("ours") for m in methods):
        libs["ours"] = _Ours()
    if any(m.startswith("dcp") for m in methods):
        libs["dcp"] = _Dcp()
    if any(m.startswith("tc") for m in methods):
        try:
            libs["tc"] = _TorchCheckpointing()
        except ImportError as e:
            if dist.get_rank() == 0:
                print(f"torch_checkpointing skipped: {e}")
            methods = [m for m in methods if not m.startswith("tc")]
    return libs, methods


def _save(libs: Dict[str, Any], method: str, state: Dict[str, Any], path: str) -> float:
    """Saves `state` to `path` by `method`; returns the seconds save() blocked (async)."""
    lib = libs[method.split("-")[0]]
    if method == "dcp-async-pinned":
        return lib.save(state, path, True, pinned=True)
    return lib.save(state, path, "-async" in method)


def _remove(path: str) -> None:
    """Collective: removes a checkpoint directory once every rank is done with it."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _path(root: str, world: int, method: str, rep: int) -> str:
    return os.path.join(root, f"w{world}", f"{method}-{rep}")


def _timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    """Collective: `fn`'s wall time from a barrier until the slowest rank finished, and its
    result."""
    dist.barrier()
    start = time.perf_counter()
    try:
        out, error = fn(), None
    except Exception as e:  # agreed on below: a rank alone leaving would hang the others
        out, error = None, e
    seconds = max_over_ranks(time.perf_counter() - start)
    if max_over_ranks(float(error is not None)):
        raise RuntimeError(f"failed on some rank: {error!r}") from error
    return seconds, out


def _cold() -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        drop_page_cache()
    dist.barrier()


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)  # a line per file read
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        import datetime

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=60),
        )
    else:
        init_world(rank, world, port, minutes=60)
        torch.set_num_threads(1)
    width = _width(args.size_mib)
    libs, methods = _libraries(list(args.methods))
    results: Dict[str, Dict[str, List[float]]] = {m: {} for m in methods}
    model, optim = _model_and_optimizer(width, world)
    saved = _state(model, optim)
    want = {k: t.clone() for k, t in _locals(saved).items()}
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    nbytes = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(nbytes)
    dest_model, dest_optim = _model_and_optimizer(width, world)
    dest = _state(dest_model, dest_optim)
    others = [w for w in args.other_worlds if w != world]
    failures: Dict[str, Dict[str, str]] = {}
    # first saves start writer processes and pools, and first loads import their code: not
    # timed, as in a training loop, where every save but the first finds them running (and
    # the same for every method: this host compiles our modules in each process, as
    # PYTHONDONTWRITEBYTECODE is set, while torch's come compiled)
    for m in methods:
        lib = libs[m.split("-")[0]]
        if args.load_only:  # one of the checkpoints the timed loads read
            path = _path(args.dir, others[0], m, args.repeats - 1)
        else:
            path = os.path.join(args.dir, f"w{world}", f"warmup-{m}")
            _save(libs, m, saved, path)
        try:
            _timed(lambda: lib.load(dest, path))
        except RuntimeError:  # a peer's failed load is reported by the timed loads
            if m.startswith("ours"):
                raise
        if not args.load_only:
            _remove(path)
    for rep in range(args.repeats):
        order = rotated(methods, rep)
        if not args.load_only:
            for m in order:
                path = _path(args.dir, world, m, rep)
                seconds, blocked = _timed(lambda: _save(libs, m, saved, path))
                results[m].setdefault("save", []).append(seconds)
                if "-async" in m:
                    results[m].setdefault("block", []).append(max_over_ranks(blocked))
        for turn in range(args.load_repeats):
            for m in rotated(methods, rep * args.load_repeats + turn):
                lib = libs[m.split("-")[0]]
                for kind, src in [("load", world)] + [("load other", w) for w in others]:
                    if (args.load_only and kind == "load") or kind in failures.get(m, {}):
                        continue  # (a failed load is not retried)
                    # another world's checkpoints: the last repeat's (the only ones kept)
                    path = _path(args.dir, src, m, rep if src == world else args.repeats - 1)
                    _scramble(dest)
                    _cold()
                    try:
                        seconds, loaded = _timed(lambda: lib.load(dest, path))
                    except RuntimeError as e:
                        if m.startswith("ours"):
                            raise
                        # a peer's failure is a result (torch_checkpointing 0.1.1 has looked
                        # for files of ranks the saving world did not have)
                        failures.setdefault(m, {})[kind] = str(e)[:160]
                        continue
                    _check(loaded, want, f"{m} {kind} of {path}")
                    results[m].setdefault(kind, []).append(seconds)
        if not args.load_only and rep < args.repeats - 1:  # disk space: keep the last
            for m in methods:
                _remove(_path(args.dir, world, m, rep))
    for lib in libs.values():
        if hasattr(lib, "close"):
            lib.close()
    if "ours" in libs:
        libs["ours"].queue.close()
    if rank == 0:
        queue.put({"bytes": int(nbytes), "results": results, "failures": failures})
    dist.destroy_process_group()


KINDS = ["save", "block", "load", "load other"]
PEERS = ["dcp", "tc"]


def _rows(world: int, res: Dict[str, Any], note: str = "") -> List[Dict[str, Any]]:
    """Table rows of one world's results: seconds (medians over the repeats) and, for our
    rows, each peer's time over ours (above 1: ours is faster)."""
    rows = []
    results = res["results"]
    for method, t in results.items():
        row: Dict[str, Any] = {"ranks": world, "GiB": round(res["bytes"] / 2**30, 2)}
        row["method"] = method
        for kind in KINDS:
            if not t.get(kind):
                continue
            row[f"{kind} s"] = ours = median(t[kind])
            for peer in PEERS if method.startswith("ours") else []:
                theirs = results.get(method.replace("ours", peer), {}).get(kind)
                if theirs:
                    row[f"{kind} x {peer}"] = median(theirs) / ours
        failed = res.get("failures", {}).get(method, {})
        for kind in failed:
            row[f"{kind} s"] = "failed"
        notes = [note] if note else []
        notes += [f"{kind}: {why}" for kind, why in failed.items()]
        if notes:
            row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--load-repeats",
        type=int,
        default=1,
        help="timed loads of each checkpoint per repeat (the methods take turns going first)",
    )
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS + CUDA_METHODS)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model lives (cuda: one GPU per rank, NCCL for the model, gloo beside)",
    )
    parser.add_argument("--dir", default="/tmp/dist_ckpt_bench_dtensor")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.methods is None:
        args.methods = METHODS + (CUDA_METHODS if args.device == "cuda" else [])
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows: List[Dict[str, Any]] = []
    raw: Dict[str, Any] = {}
    done: List[int] = []
    for world in args.world_sizes:
        opts = argparse.Namespace(**vars(args), other_worlds=done[:], load_only=False)
        res = run_world(_worker, world, opts)
        raw[str(world)] = res
        rows += _rows(world, res)
        done.append(world)
    if len(args.world_sizes) > 1:  # the first world loads what the later ones saved
        first = args.world_sizes[0]
        opts = argparse.Namespace(**vars(args), other_worlds=done[1:], load_only=True)
        res = run_world(_worker, first, opts)
        raw[f"{first}-other"] = res
        rows += _rows(first, res, note=f"from {done[1:]}")
    columns = ["ranks", "GiB", "method"]
    for kind in KINDS:
        columns += [f"{kind} s"] + [f"{kind} x {peer}" for peer in PEERS]
    title = (
        "FSDP2 model + Adam (seconds; x PEER: the peer's time over ours, above 1: ours is faster)"
    )
    print_table(title, rows, columns + ["note"])
    if args.json:
        write_json(args.json, {"rows": rows, "raw": raw})
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
