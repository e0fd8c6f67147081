"""The `parity` phase of `bench_local`: parity replication (k ranks per group, one rank per
"node") against clique replication factor 2, on one gloo world of `--parity-world` ranks,
`--parity-mib` MiB of fp32 per rank.

Per round (medians over `--repeats`; each sample the max over ranks), rows taking turns:
sync save of each (each after an untimed `sync`); bytes kept per rank after it (files of the
newest iteration, spares excluded, over the state's bytes); async save: how long `save()` +
`schedule_async_request` block, and when it is committed (after one untimed async save of
each kind, which refills the pools the round before emptied); plain load (a fresh manager, page
cache dropped); recovery after the last rank's directory is lost (moved aside, put back
after): a copy sent by the clique peer, or the part rebuilt from its group's parity; and the
load of the same state from the persistent tier (`torch_dist`, page cache dropped). Two
untimed saves per manager come first (the timed ones write over spares, as in training).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks._common import init_world, max_over_ranks, median, rotated

__all__ = ["parity_worker", "parity_table"]

_N_TENSORS = 8


def _files_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if not f.startswith("spare_") and not f.endswith(".dirty.pt")
    )


def parity_worker(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    import time

    from benchmarks.bench_local import _drop_cache, _Samples, _settle

    init_world(rank, world, port)
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.integrity import checksum
    from dist_checkpointing.local import _image
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from dist_checkpointing.local.replication import _stream
    from dist_checkpointing.local.replication import parity as _parity
    from dist_checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
        ParityReplicationStrategy,
    )
    from dist_checkpointing.storage import ImagePool
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    per_rank = args.parity_mib << 20
    numel = per_rank // _N_TENSORS // 4

    def make() -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return {f"t{i}": torch.randn(numel, generator=g) for i in range(_N_TENSORS)}

    # The state lives only while it is saved: loads compare what they read with its digests
    # (so 4 ranks of 1 GiB fit on a small host: the state, a loaded copy and a part read for
    # a peer's recovery would be 3 GiB per rank).
    tensors = make()
    digests = {n: checksum(t.view(-1).view(torch.uint8).numpy()) for n, t in tensors.items()}
    shapes = {n: t.shape for n, t in tensors.items()}
    state_bytes = sum(t.numel() * 4 for t in tensors.values())
    root = os.path.join(args.dir, "parity")
    node, persistent = os.path.join(root, f"node{rank}"), os.path.join(root, "persistent")
    os.makedirs(node, exist_ok=True)
    k = args.parity_k
    strategies = {
        "clique f2": (CliqueReplicationStrategy.from_replication_params(1, 2), "c2"),
        f"parity k{k}": (ParityReplicationStrategy.from_replication_params(1, k), f"p{k}"),
    }
    managers = {n: LocalCheckpointManager(node, sid, repl) for n, (repl, sid) in strategies.items()}
    s = _Samples()

    def state() -> Any:
        return BasicTensorAwareStateDict(dict(tensors))

    def sharded(fill: bool = True) -> Dict[str, Any]:
        return {
            n: ShardedTensor.from_rank_offsets(
                n, tensors[n] if fill else torch.empty(shape), (0, rank, world)
            )
            for n, shape in shapes.items()
        }

    def same(got: Dict[str, Any], what: str) -> None:
        for n, want in digests.items():
            assert checksum(got[n].view(-1).view(torch.uint8).numpy()) == want, (what, n)

    loaded: List[Any] = []

    def load(name: str) -> None:
        repl, sid = strategies[name]
        fresh = LocalCheckpointManager(node, sid, repl)
        loaded.append(fresh.load()[0])

    def check(name: str) -> None:  # outside the timed region
        same(loaded.pop().state_dict, name)
        gc.collect()

    for m in managers.values():
        for it in (1, 2):
            m.save(state(), it)
    dc.save(sharded(), persistent)
    queue_ = AsyncCallsQueue()
    kept: Dict[str, List[float]] = {}
    for i in range(args.repeats):
        it = 10 * (i + 1)
        if not tensors:
            tensors.update(make())
        rows: List[Tuple[str, Any]] = [
            (f"{n} save s", lambda m=m: m.save(state(), it)) for n, m in managers.items()
        ]
        for key, fn in rotated(rows, i):
            _settle(rank)
            s.timed(key, fn)
        for n, m in managers.items():
            ratio = _files_bytes(str(m.local_ckpt_dir)) / state_bytes
            kept.setdefault(n, []).append(max_over_ranks(ratio))
        # the pools were emptied at the end of the last round (below): one untimed async save
        # of each kind refills them, as the saves of a training run find them filled; else
        # the kind going first paid the refill (seconds) and the rotation favoured one kind
        for m in managers.values():
            queue_.schedule_async_request(m.save(state(), it + 1, is_async=True))
            queue_.maybe_finalize_async_calls(blocking=True)
        for n, m in rotated(list(managers.items()), i):
            _settle(rank)
            dist.barrier()
            t0 = time.perf_counter()
            queue_.schedule_async_request(m.save(state(), it + 2, is_async=True))
            blocked = max_over_ranks(time.perf_counter() - t0)
            queue_.maybe_finalize_async_calls(blocking=True)
            s.add(f"{n} async blocks s", blocked)
            s.add(f"{n} async final s", max_over_ranks(time.perf_counter() - t0))
        # until the next round's saves: no state, and neither the staging buffer the async
        # saves keep for the next one nor the receive buffers the exchanges keep
        tensors.clear()
        _image._POOL = ImagePool(max_free=1, max_signatures=2)
        _stream._free.clear()
        _parity._free.clear()
        gc.collect()
        for n in rotated(list(managers), i):
            _drop_cache(rank)
            s.timed(f"{n} load s", lambda n=n: load(n))
            check(n)
        for n in rotated(list(managers), i):
            lost = str(managers[n].local_ckpt_dir)
            dist.barrier()
            if rank == world - 1:
                os.rename(lost, lost + ".lost")
            _drop_cache(rank)
            s.timed(f"{n} recovery s", lambda n=n: load(n))
            check(n)
            dist.barrier()
            if rank == world - 1:
                os.rename(lost + ".lost", lost)
        _drop_cache(rank)
        got: List[Any] = []
        s.timed("persistent load s", lambda: got.append(dc.load(sharded(fill=False), persistent)))
        same(got.pop(), "persistent")
        gc.collect()
    queue_.close()
    out = s.results()
    for n, v in kept.items():
        out[f"{n} bytes kept / state"] = median(v)
    out["GB per rank"] = state_bytes / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    out["peak RSS GiB per rank (max)"] = max_over_ranks(rss)
    dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()
    shutil.rmtree(node, ignore_errors=True)


def parity_table(res: Dict[str, Any], k: int) -> List[Dict[str, Any]]:
    """Rows `what, clique f2, parity k, ratio` (goals from issue 49)."""
    p, c = f"parity k{k}", "clique f2"
    rows = []
    spec = [
        ("bytes kept / state", "bytes kept per rank / state", f"<= {1 + 1 / (k - 1) + 0.02:.2f}"),
        ("save s", "sync save s", "<= 1"),
        ("async blocks s", "async save: save() blocks s", "<= 1"),
        ("async final s", "async save: committed s", "<= 1"),
        ("load s", "plain load s", ""),
        ("recovery s", "recovery of a lost node's part s", "<= 1.5"),
    ]
    for key, what, goal in spec:
        a, b = res.get(f"{c} {key}"), res.get(f"{p} {key}")
        if a is None or b is None:
            continue
        ratio = f"{b / a:.2f}" + (f" (goal {goal})" if goal else "")
        rows.append({"what": what, "clique f2": a, p: b, "parity / clique": ratio})
    if "persistent load s" in res and f"{p} recovery s" in res:
        ratio = res[f"{p} recovery s"] / res["persistent load s"]
        rows.append(
            {
                "what": "persistent tier load s",
                "clique f2": res["persistent load s"],
                p: "",
                "parity / clique": f"parity recovery / persistent load {ratio:.2f}",
            }
        )
    # nvidia-resiliency-ext's factor 2 in the baseline column; ours over it in the ratio
    versus = {
        "nvrx f2 s": f"{p} save s",
        "nvrx load cold s": f"{p} load s",  # ours: page cache dropped too
        "nvrx bytes kept / state": f"{p} bytes kept / state",
    }
    for key in ("nvrx f2 s", "nvrx load s", "nvrx load cold s", "nvrx bytes kept / state"):
        if key in res:
            row = {"what": key.replace("nvrx", "nvidia-resiliency-ext"), "clique f2": res[key]}
            ours = versus.get(key)
            if ours in res:
                mine = res[ours] / res[key]
                clique = res[ours.replace(p, c)] / res[key]
                row["parity / clique"] = f"parity {mine:.2f}x, clique {clique:.2f}x of it"
            rows.append(row)
    return rows
