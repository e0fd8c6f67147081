"""Local checkpoints: each rank saves to its own directory, with a copy on another rank.

    torchrun --standalone --nproc-per-node 2 examples/local_checkpoints.py [ROOT]

Each rank writes its part of the state under ROOT/rank_<r> (a node-local disk in a real
job) and, through `CliqueReplicationStrategy`, a copy of its peer's part. The example then
deletes rank 1's directory (a lost node) and recovers: rank 1's part comes back from the
copy rank 0 holds.
"""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py

from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = output_dir("local")
    mine = root / f"rank_{rank}"  # stands for this node's local disk
    if mine.exists():
        shutil.rmtree(mine)  # a fresh run
    dist.barrier()

    # Cliques of 2 ranks, 1 apart: ranks 0 and 1 hold each other's parts.
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    mgr = LocalCheckpointManager(mine, session_id="run42", repl_strategy=repl)
    queue = AsyncCallsQueue()
    for iteration in (10, 20):
        state = {"w": torch.full((4, 4), float(rank * 100 + iteration)), "it": iteration}
        queue.schedule_async_request(
            mgr.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
        )
    # A save counts only once finalized on every rank: before that, find_latest() ignores it.
    queue.close()

    # Lose rank 1's directory, then recover as a restarted job would (a fresh manager).
    if rank == 1:
        shutil.rmtree(mine)
    dist.barrier()
    mgr = LocalCheckpointManager(mine, session_id="run42", repl_strategy=repl)
    latest = mgr.find_latest()  # collective; the same answer on every rank
    assert latest == 20, latest
    wrapper, ckpt_id = mgr.load()  # a wrapper: the state is in wrapper.state_dict
    state = wrapper.state_dict
    assert state["it"] == 20 and torch.equal(state["w"], torch.full((4, 4), rank * 100 + 20.0))
    print(f"rank {rank}: recovered iteration {latest} ({ckpt_id}): OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
