"""Quickstart: save a sharded tensor on 2 ranks, load it back split another way.

Each rank holds a column block of a 1024 x 4096 weight. The checkpoint is loaded as row
blocks instead (resharding), and every value is checked.

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py [CKPT_ROOT]

Running it again reuses CKPT_ROOT (default: a temporary directory): the example removes its
old checkpoint first, because `save` never overwrites a complete checkpoint.
"""

from __future__ import annotations

import logging
import shutil

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor


def main() -> None:
    # show the library's INFO lines: bytes, files, seconds and GB/s of each save and load
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = output_dir("quickstart")
    ckpt = root / "iter_0000100"
    if rank == 0 and ckpt.exists():
        shutil.rmtree(ckpt)  # save() refuses to overwrite a complete checkpoint
    dist.barrier()

    full = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    cols = 4096 // world
    local = full[:, rank * cols : (rank + 1) * cols].clone()  # this rank's column block
    state = {
        # (axis, this rank's position on it, number of pieces)
        "w": ShardedTensor.from_rank_offsets("w", local, (1, rank, world)),
        "step": 100,  # plain values are saved once, by rank 0
    }
    dc.save(state, ckpt)  # collective: every rank calls it

    # Load with another split: row blocks. Any world size works the same way.
    rows = 1024 // world
    want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(rows, 4096), (0, rank, world))}
    loaded = dc.load(want, ckpt)
    assert loaded["step"] == 100
    assert torch.equal(loaded["w"], full[rank * rows : (rank + 1) * rows])
    if rank == 0:
        print(f"saved column blocks and loaded row blocks of 'w' from {ckpt}: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
