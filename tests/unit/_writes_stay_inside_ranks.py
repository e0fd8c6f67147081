"""Rank side of `test_writes_stay_inside.py`: every write path of the library on 2 gloo ranks.

    python _writes_stay_inside_ranks.py CKPT_ROOT

Run as a script in a fresh process whose environment the test sets (empty HOME,
XDG_CACHE_HOME and TMPDIR): it spawns 2 ranks (multiprocessing 'spawn', so they inherit
that environment from their start), and each rank saves and loads under CKPT_ROOT only:

    sync/iter_0000001         save (torch_dist), load, resharded load, metadata loads
    big/iter_0000001          save and load of 128 MiB per rank (measured I/O paths)
    async/iter_0000002        save(async_sharded_save=True) through AsyncCallsQueue()
    async/iter_0000003        the same through AsyncCallsQueue(persistent=True)
    node_<rank>/iter_0000100  the ('local', 2) backend, replicated; node_1 lost, recovered
    localmgr/rank_<rank>      LocalCheckpointManager + CliqueReplicationStrategy; rank_1
                              lost, recovered from its replica
    manager/persistent        CheckpointManager, persistent tier (retention: keep_last=2)
    manager/local             CheckpointManager, local tier (replicated)

It prints `PIDS <pid> ...` (itself and its ranks) and exits 0 only when every rank
finished every step. Imports only `dist_checkpointing` and torch: the test points
PYTHONPATH at the tree under test.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict

WORLD = 2
ROWS, COLS = 8, 6  # the global 'w'
#: rows of 4 KiB in each rank's block of 'big': 128 MiB and a bit
BIG_ROWS = (128 << 20) // 4096 + 64
TIMEOUT_S = 90.0


def sharded_state(rank: int, world: int, axis: int = 0, fill: bool = True) -> Dict[str, Any]:
    """'w' split on `axis` (row blocks by default), a ShardedObject grid, a plain value."""
    import torch

    from dist_checkpointing import ShardedObject, ShardedTensor

    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    block = full.chunk(world, dim=axis)[rank].clone()
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", block if fill else torch.zeros_like(block), (axis, rank, world)
        ),
        "obj": ShardedObject("obj", {"rank": rank} if fill else None, (world,), (rank,)),
        "step": 7,
    }


def check(state: Dict[str, Any], rank: int, world: int, axis: int = 0) -> None:
    import torch

    want = sharded_state(rank, world, axis)
    assert torch.equal(state["w"], want["w"].data), (axis, state["w"])
    assert state["obj"] == {"rank": rank}, state["obj"]
    assert state["step"] == 7, state["step"]


def _rank(rank: int, port: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    import dist_checkpointing as dc
    from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
    from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from dist_checkpointing.strategies.local import LocalSaveShardedStrategy

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    world = WORLD
    base = Path(root)

    # save, load, resharded load, the metadata loads
    sync = base / "sync" / "iter_0000001"
    dc.save(sharded_state(rank, world), sync)
    check(dc.load(sharded_state(rank, world, fill=False), sync), rank, world)
    check(dc.load(sharded_state(rank, world, axis=1, fill=False), sync), rank, world, axis=1)
    full = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS), replica_id=rank)}
    loaded = dc.load(full, sync)
    assert torch.equal(loaded["w"], torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, -1))
    assert dc.load_common_state_dict(sync)["step"] == 7
    assert tuple(dc.load_tensors_metadata(sync)["w"].global_shape) == (ROWS, COLS)

    # a save and load large enough for the library's measured I/O paths (a write-path probe
    # from 64 MiB per rank, a read-path probe from data files of 128 MiB), which decide
    # once per file system and may remember their answers: in the checkpoint directory only
    big_block = torch.full((BIG_ROWS, 1024), float(rank + 1))
    big = base / "big" / "iter_0000001"
    dc.save({"big": ShardedTensor.from_rank_offsets("big", big_block, (0, rank, world))}, big)
    del big_block
    want = {
        "big": ShardedTensor.from_rank_offsets("big", torch.empty(BIG_ROWS, 1024), (0, rank, world))
    }
    got = dc.load(want, big)["big"]
    assert bool((got == float(rank + 1)).all())
    del got, want

    # async saves: a forked writer per save, then a persistent (spawned) writer
    for persistent, step in ((False, 2), (True, 3)):
        queue = AsyncCallsQueue(persistent=persistent)
        ckpt = base / "async" / f"iter_{step:07d}"
        queue.schedule_async_request(
            dc.save(sharded_state(rank, world), ckpt, async_sharded_save=True)
        )
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        check(dc.load(sharded_state(rank, world, axis=1, fill=False), ckpt), rank, world, axis=1)

    # cliques of 2 ranks: each rank keeps a copy of the other's local part
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )

    # the ('local', 2) backend through save/load; node 1 lost, its part from rank 0's copy
    node_ckpt = base / f"node_{rank}" / "iter_0000100"
    dc.save(
        sharded_state(rank, world),
        node_ckpt,
        sharded_strategy=LocalSaveShardedStrategy("local", 2, repl_strategy=repl),
    )
    dist.barrier()
    if rank == 1:
        shutil.rmtree(node_ckpt)
    dist.barrier()
    check(dc.load(sharded_state(rank, world, fill=False), node_ckpt), rank, world)

    # LocalCheckpointManager with replication; rank 1's directory lost, then recovered
    mine = base / "localmgr" / f"rank_{rank}"
    mgr = LocalCheckpointManager(mine, session_id="run", repl_strategy=repl)
    queue = AsyncCallsQueue()
    for iteration in (10, 20):
        state = {"t": torch.full((4, 4), float(rank * 100 + iteration)), "it": iteration}
        queue.schedule_async_request(
            mgr.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
        )
    queue.close()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(mine)
    dist.barrier()
    mgr = LocalCheckpointManager(mine, session_id="run", repl_strategy=repl)
    assert mgr.find_latest() == 20
    wrapper, _ = mgr.load()
    assert wrapper.state_dict["it"] == 20
    assert torch.equal(wrapper.state_dict["t"], torch.full((4, 4), rank * 100 + 20.0))

    # CheckpointManager: both tiers, async persistent saves, retention, load
    options = CheckpointManagerOptions(
        save_interval=2,
        keep_last=2,
        local_root=str(base / "manager" / "local"),
        local_save_interval=1,
        replication=repl,
    )
    manager = CheckpointManager(base / "manager" / "persistent", options)
    for step in range(1, 7):
        manager.save(step, sharded_state(rank, world))
    manager.close()
    manager = CheckpointManager(base / "manager" / "persistent", options)
    assert manager.all_steps() == [4, 6], manager.all_steps()
    assert manager.latest_step() == 6
    state, step = manager.load(sharded_state(rank, world, fill=False))
    assert step == 6
    check(state, rank, world)
    manager.close()

    dist.barrier()
    dist.destroy_process_group()


def _rank_main(rank: int, port: int, root: str) -> None:
    try:
        _rank(rank, port, root)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main() -> int:
    root = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, port, root)) for r in range(WORLD)]
    for p in procs:
        p.start()
    print("PIDS", os.getpid(), *(p.pid for p in procs), flush=True)
    deadline = time.monotonic() + TIMEOUT_S
    # a rank that failed leaves the other waiting in a collective: stop at the first failure
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    if codes != [0] * WORLD:
        print(f"rank exit codes {codes} (None: killed after {TIMEOUT_S:.0f} s)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
