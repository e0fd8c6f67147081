"""Fully parallel save and load of CUDA tensors (run by the GPU-marked tests).

Usage: python _fp_nccl.py WORKDIR BACKEND WORLD. Spawns WORLD ranks whose default process
group uses BACKEND (`nccl` or `gloo`); rank r holds its tensors on `cuda:(r % GPUs)`, so on
a machine with one GPU every rank of a gloo world shares `cuda:0` (NCCL refuses two ranks
on one device: its worlds need a GPU per rank). Every rank holds replicas of six tensors
(so the fully parallel wrappers split their writing and reading and exchange the shards)
and its own row block of a seventh, loaded back as a column block (resharded). Prints OK
when every rank got every tensor back on its CUDA device with the saved values and each
replicated shard was read by exactly one rank. Without CUDA it runs on CPU tensors (gloo
only), so the same logic can be checked on any machine.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, workdir: str, backend: str) -> None:
    import dist_checkpointing as dc
    from dist_checkpointing.mapping import ShardedTensor
    from dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    fulls = [torch.arange(1000 * (i + 1), dtype=torch.float32) + i for i in range(6)]
    tp_full = torch.arange(8 * 4 * world, dtype=torch.float32).reshape(4 * world, 8)

    def state(load: bool) -> dict:
        sd = {
            f"rep{i}": ShardedTensor.from_rank_offsets(
                f"rep{i}",
                (torch.zeros_like(t) if load else t.clone()).to(device),
                replica_id=rank,
            )
            for i, t in enumerate(fulls)
        }
        axis = 1 if load else 0  # saved by rows, loaded by columns
        piece = tp_full.chunk(world, dim=axis)[rank]
        sd["tp"] = ShardedTensor.from_rank_offsets(
            "tp",
            (torch.zeros_like(piece) if load else piece.clone()).to(device),
            (axis, rank, world),
        )
        return sd

    ckpt = os.path.join(workdir, "ckpt")
    dc.save(
        state(False),
        ckpt,
        sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()),
    )
    base = TorchDistLoadShardedStrategy()
    read = []
    base_load = base.load

    def recording_load(sharded_state_dict, checkpoint_dir):  # which shards this rank reads
        read.extend(k for k in sharded_state_dict if k.startswith("rep"))
        return base_load(sharded_state_dict, checkpoint_dir)

    base.load = recording_load  # type: ignore[method-assign]
    out = dc.load(state(True), ckpt, sharded_strategy=FullyParallelLoadStrategyWrapper(base))
    for i, t in enumerate(fulls):
        got = out[f"rep{i}"]
        assert got.device == device, (i, got.device)
        assert torch.equal(got.cpu(), t), i
    assert out["tp"].device == device
    assert torch.equal(out["tp"].cpu(), tp_full.chunk(world, dim=1)[rank])
    everyone: list = [None] * world
    # over a gloo group: the default group may be NCCL, which moves only CUDA tensors
    dist.all_gather_object(everyone, read, group=dist.new_group(backend="gloo"))
    reads = sorted(k for per_rank in everyone for k in per_rank)
    assert reads == sorted(f"rep{i}" for i in range(len(fulls))), reads
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    workdir, backend, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(worker, args=(world, _port(), workdir, backend), nprocs=world, join=True)
    print("OK")
