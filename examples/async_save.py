"""Async save: training continues while a background process writes the checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/async_save.py [CKPT_ROOT]

`AsyncCallsQueue(persistent=True)` keeps one writer process per rank. It is started with
multiprocessing's 'spawn', which re-runs the main script's top level in the writer, so the
script's code must sit under `if __name__ == "__main__":` (as here); without the guard,
`schedule_async_request` raises a `CheckpointingException` that says so.
"""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = output_dir("async")
    if rank == 0 and root.exists():
        shutil.rmtree(root)  # a fresh run: save() never overwrites a complete checkpoint
    dist.barrier()

    weight = torch.zeros(256, 64 // world)
    queue = AsyncCallsQueue(persistent=True)  # once per process
    for step in range(1, 7):
        weight += 1  # "training"
        queue.maybe_finalize_async_calls()  # every step, on every rank: commits finished saves
        if step % 3 == 0:
            state = {"w": ShardedTensor.from_rank_offsets("w", weight, (1, rank, world))}
            request = dc.save(state, root / f"iter_{step:07d}", async_sharded_save=True)
            queue.schedule_async_request(request)  # returns once the shards are copied
    queue.close()  # on every rank: waits for the outstanding saves and commits them

    # What was saved is the state at the moment save() returned: step 6 -> all sixes.
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(256, 64), replica_id=rank)}
    loaded = dc.load(want, root / "iter_0000006")
    assert torch.equal(loaded["w"], torch.full((256, 64), 6.0))
    if rank == 0:
        print(f"async saves committed: {sorted(p.name for p in root.iterdir())}: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
