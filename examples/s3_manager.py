"""CheckpointManager with a node-local tier and a persistent tier on S3-compatible storage.

Every 2 steps each rank keeps a checkpoint on its node's disk (`local_dir`); every 4 steps
a persistent `torch_dist` checkpoint goes to `s3://bucket/prefix`, committed by its
`metadata.json` marker written last; the 2 newest persistent ones are kept. Run it again
with more steps and it resumes from the newest complete checkpoint of either tier.
Endpoint and credentials come from the standard AWS environment (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`); needs
`pip install 'dist_checkpointing[s3]'`.

    torchrun --standalone --nproc-per-node 2 examples/s3_manager.py /tmp/local s3://bucket/run
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("local_dir", help="node-local tier (a directory on this node)")
    parser.add_argument("url", help="persistent tier, s3://bucket/prefix")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(4, 8)  # this rank's row block of a (4 x world, 8) weight

    def state() -> Dict[str, Any]:
        return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}

    options = CheckpointManagerOptions(
        save_interval=4, keep_last=2, local_root=args.local_dir, local_save_interval=2
    )
    with CheckpointManager(args.url, options) as manager:
        start = 1
        if manager.latest_step() is not None:
            loaded, step = manager.load(state())
            w.copy_(loaded["w"])
            start = step + 1
            if rank == 0:
                print(f"resumed from step {step}, w = {float(w[0, 0])}", flush=True)
        for step in range(start, args.steps + 1):
            w.add_(1.0)  # a training step
            manager.save(step, state())
    if rank == 0:
        print(f"persistent checkpoints in {args.url}: steps {manager.all_steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
