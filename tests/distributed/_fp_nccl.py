"""Fully parallel save and load of CUDA tensors with NCCL as the default backend (2 ranks).

Usage: python _fp_nccl.py WORKDIR. Run by the GPU-marked test; prints OK when every rank
loaded every tensor back onto its CUDA device with the saved values. Both ranks may share
one GPU: the library coordinates on its own gloo group, so no NCCL collective runs.
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


def worker(rank: int, world: int, port: int, workdir: str) -> None:
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

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    fulls = [torch.arange(1000 * (i + 1), dtype=torch.float32) + i for i in range(6)]

    def state(load: bool) -> dict:
        return {
            f"rep{i}": ShardedTensor.from_rank_offsets(
                f"rep{i}",
                (torch.zeros_like(t) if load else t.clone()).to(device),
                replica_id=rank,
            )
            for i, t in enumerate(fulls)
        }

    ckpt = os.path.join(workdir, "ckpt")
    dc.save(
        state(False),
        ckpt,
        sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()),
    )
    out = dc.load(
        state(True),
        ckpt,
        sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
    )
    for i, t in enumerate(fulls):
        got = out[f"rep{i}"]
        assert got.device == device, (i, got.device)
        assert torch.equal(got.cpu(), t), i
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, _port(), sys.argv[1]), nprocs=2, join=True)
    print("OK")
