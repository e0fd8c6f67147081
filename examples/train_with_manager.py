"""A small data-parallel training loop that checkpoints with `CheckpointManager`.

Two gloo ranks on the CPU train a linear model (replicated weights, gradients averaged
with all-reduce). The manager saves a node-local checkpoint every 2 steps and a persistent
`torch_dist` checkpoint every 10 (both in the background), keeps the last 2 persistent
ones, and on start resumes from the newest usable checkpoint of either tier.

Run it, interrupt it (Ctrl-C, or `kill -9` one rank), run it again: it continues from
the newest complete checkpoint and the loss picks up where it was. With `--parity K` the
local tier survives the loss of one node (here: one rank's local directory) per group of K
by XOR parity (`ParityReplicationStrategy`).

    python examples/train_with_manager.py /tmp/run1 --steps 60
    python examples/train_with_manager.py /tmp/run2 --world-size 4 --parity 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
from dist_checkpointing.local.replication.strategies import ParityReplicationStrategy

FEATURES, OUTPUTS, BATCH = 16, 4, 32


def sharded_state(w: torch.Tensor, momentum: torch.Tensor) -> Dict[str, Any]:
    """The training state as a sharded state dict: every rank holds a replica."""
    rank = dist.get_rank()
    return {
        "model.weight": ShardedTensor.from_rank_offsets("model.weight", w, replica_id=rank),
        "optim.momentum": ShardedTensor.from_rank_offsets(
            "optim.momentum", momentum, replica_id=rank
        ),
    }


def batch(step: int, rank: int) -> Any:
    """This rank's batch of `step` (deterministic, so a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    target = x @ torch.linspace(-1, 1, FEATURES * OUTPUTS).reshape(FEATURES, OUTPUTS)
    return x, target + 0.01 * torch.randn(BATCH, OUTPUTS, generator=g)


def train(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    replication = None
    if args.parity:  # collective: every rank builds it; one rank per "node" here
        replication = ParityReplicationStrategy.from_replication_params(1, args.parity)
    options = CheckpointManagerOptions(
        save_interval=10,  # persistent (torch_dist, async) checkpoint every 10 steps
        keep_last=2,  # keep the 2 newest complete ones
        local_root=os.path.join(args.ckpt_dir, "local"),  # node-local tier ...
        local_save_interval=2,  # ... every 2 steps
        replication=replication,  # None: the local tier is not replicated
    )
    manager = CheckpointManager(os.path.join(args.ckpt_dir, "persistent"), options)
    w = torch.zeros(FEATURES, OUTPUTS)
    momentum = torch.zeros_like(w)
    start = 1
    if manager.latest_step() is not None:  # a restart: resume from the newest usable one
        state, step = manager.load(sharded_state(w, momentum))
        w.copy_(state["model.weight"])
        momentum.copy_(state["optim.momentum"])
        start = step + 1
        if rank == 0:
            tier = manager.last_restore.tier if manager.last_restore else "?"
            print(f"resumed from step {step} ({tier})", flush=True)
    for step in range(start, args.steps + 1):
        x, target = batch(step, rank)
        error = x @ w - target
        loss = (error**2).mean()
        grad = 2 * x.T @ error / error.numel()
        dist.all_reduce(grad)
        grad /= world
        momentum.mul_(0.9).add_(grad)
        w.sub_(0.05 * momentum)
        losses = loss.detach().reshape(1)
        dist.all_reduce(losses)
        if rank == 0:
            print(f"step {step} loss {float(losses) / world:.10f}", flush=True)
        manager.save(step, sharded_state(w, momentum))  # returns at once when nothing is due
        time.sleep(args.sleep)
    manager.close()  # waits for the saves in flight
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="where checkpoints go (persistent/ and local/)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--parity", type=int, default=0, help="parity group size of the local tier (0: none)"
    )
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (demo pace)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            train,
            args=(args.world_size, os.path.join(tmp, "rendezvous"), args),
            nprocs=args.world_size,
        )


if __name__ == "__main__":
    main()
