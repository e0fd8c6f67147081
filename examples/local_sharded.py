"""Local checkpoints of a sharded state dict, the two ways megatron-style loops use them.

    torchrun --standalone --nproc-per-node 2 examples/local_sharded.py [ROOT]

1. `MCoreTensorAwareStateDict` handed to a `LocalCheckpointManager`: with
   `algo="fully_parallel"` the replicated tensor ('bias', the same on both ranks) is stored
   by one rank only, and `to_state_dict` sends it to the other at load.
2. The `('local', 2)` backend through the usual `save` / `load`, with a copy of each rank's
   part on the other rank; rank 1's directory is then deleted (a lost node) and its part
   comes back from that copy.

Each rank uses ROOT/node_<rank> (ROOT default: a temporary directory): a node-local disk in a real
job. A rerun starts afresh.
"""

from __future__ import annotations

import shutil
from typing import Any, Dict

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.local import LocalSaveShardedStrategy
from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict


def sharded_state(rank: int, world: int, fill: bool) -> Dict[str, Any]:
    """Row blocks of 'w' (one per rank), a replicated 'bias', and a plain value."""
    w = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)[rank * 4 : (rank + 1) * 4]
    bias = torch.arange(8, dtype=torch.float32)
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", w if fill else torch.zeros(4, 8), (0, rank, world)
        ),
        "bias": ShardedTensor.from_rank_offsets(
            "bias", bias if fill else torch.zeros(8), replica_id=rank
        ),
        "iteration": 100,
    }


def check(state: Dict[str, Any], rank: int, world: int) -> None:
    want = sharded_state(rank, world, fill=True)
    assert torch.equal(state["w"], want["w"].data), state["w"]
    assert torch.equal(state["bias"], want["bias"].data), state["bias"]
    assert state["iteration"] == 100


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = output_dir("local_sharded")
    node = root / f"node_{rank}"  # stands for this node's local disk
    if node.exists():
        shutil.rmtree(node)  # a fresh run
    dist.barrier()
    # cliques of 2 ranks, 1 apart: ranks 0 and 1 hold copies of each other's parts
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    dp_group = dist.new_group(list(range(world)))  # the ranks holding replicas of 'bias'

    # 1. MCoreTensorAwareStateDict with the local checkpoint manager
    mgr = LocalCheckpointManager(node / "mgr", session_id="run42", repl_strategy=repl)
    sharded_sd = sharded_state(rank, world, fill=True)
    tasd, cache = MCoreTensorAwareStateDict.from_state_dict(
        sharded_sd, algo="fully_parallel", parallelization_group=dp_group, cached_metadata=None
    )
    queue = AsyncCallsQueue()
    queue.schedule_async_request(mgr.save(tasd, 100, is_async=True))
    queue.close()  # a save counts only once finalized on every rank
    mgr = LocalCheckpointManager(node / "mgr", session_id="run42", repl_strategy=repl)
    assert mgr.find_latest() == 100  # a fresh manager, as after a restart
    tasd, _ = mgr.load()
    state_dict = tasd.to_state_dict(sharded_state(rank, world, fill=False), algo="fully_parallel")
    check(state_dict, rank, world)
    print(f"rank {rank}: MCoreTensorAwareStateDict through the manager: OK", flush=True)

    # 2. The ('local', 2) backend through dc.save / dc.load, and a lost node
    strategy = LocalSaveShardedStrategy("local", 2, repl_strategy=repl)
    ckpt = node / "ckpt" / "iter_0000100"
    dc.save(sharded_state(rank, world, fill=True), ckpt, sharded_strategy=strategy)
    if rank == 1:
        shutil.rmtree(node / "ckpt")
    dist.barrier()
    state = dc.load(sharded_state(rank, world, fill=False), ckpt)  # rank 1's part: the copy
    check(state, rank, world)
    print(f"rank {rank}: ('local', 2) backend, recovered after losing node 1: OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
