"""Functions run on every rank of a test world (module-level so they can be sent)."""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from tests.compat import _fake_megatron as fake


def save_with_unhandled_leaf_on_one_rank(ckpt: str) -> str:
    """Rank 1 hides a look-alike sharded leaf; every rank must raise, naming its key."""
    rank = dist.get_rank()
    sd: Dict[str, Any] = {
        "w": fake.ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, 2))
    }
    if rank == 1:
        sd["extra"] = {"inner": [fake.LookAlike("odd")]}
    try:
        dc.save(sd, ckpt)
    except dc.CheckpointingException as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def save_and_load_hidden_megatron_tensors(ckpt: str) -> Any:
    """Megatron tensors inside plain dicts/lists of the common state, sharded across ranks."""
    rank = dist.get_rank()
    full = torch.arange(8.0)

    def state(data: torch.Tensor, axis_rank: int) -> Dict[str, Any]:
        return {
            "extra": {
                "list": [{"w": fake.ShardedTensor.from_rank_offsets("w", data, (0, axis_rank, 2))}]
            },
            "step": 3,
        }

    dc.save(state(full[rank * 4 : rank * 4 + 4].clone(), rank), ckpt)
    # reload with the halves swapped between ranks
    other = 1 - rank
    out = dc.load(state(torch.zeros(4), other), ckpt)
    common = dc.load_common_state_dict(ckpt)
    return bool(torch.equal(out["extra"]["list"][0]["w"], full[other * 4 : other * 4 + 4])), common
