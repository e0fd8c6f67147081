"""Failing states and assertions shared by the failure tests on 2 ranks.

The state builders run on every rank of a test world (module-level so they can be sent);
`test_failures.py` checks the exception classes and `test_megatron_phrases.py` megatron-core's
wording on the same failures. The `world` and `saved` fixtures are in `conftest.py`.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy

WORLD = 2


def assert_all_raise(
    outcomes: List[Any], cls: type = CheckpointingException, *phrases: str
) -> None:
    """Every rank raised a `cls` whose message holds every phrase."""
    for o in outcomes:
        assert o.error is not None, f"rank {o.rank} did not raise"
        assert isinstance(o.error, cls), f"rank {o.rank}: {type(o.error).__name__}: {o.trace}"
        for phrase in phrases:
            assert phrase in str(o.error), f"rank {o.rank}: {phrase!r} not in {o.error}"


def _rank() -> int:
    return dist.get_rank()


def good_state() -> Dict[str, Any]:
    r, w = _rank(), dist.get_world_size()
    local = (
        torch.arange(8 * 4, dtype=torch.float32)
        .reshape(8, 4)[:, r * (4 // w) : (r + 1) * (4 // w)]
        .clone()
    )
    return {
        "a": ShardedTensor.from_rank_offsets("a", local, (1, r, w)),
        "b": ShardedTensor.from_rank_offsets("b", torch.ones(3), replica_id=r),
        "obj": ShardedObject("rng", {"seed": r}, (w,), (r,)),
        "step": 7,
    }


def request_only_a() -> Dict[str, Any]:
    r, w = _rank(), dist.get_world_size()
    return {"a": ShardedTensor.from_rank_offsets("a", torch.empty(8, 4 // w), (1, r, w))}


def request_a_here_b_on_rank1() -> Dict[str, Any]:
    """Rank 1 asks for all of `b`, the others for all of `a` (rank 0 its main replica)."""
    if _rank() == 1:
        return {"b": ShardedTensor.from_rank_offsets("b", torch.empty(3))}
    return {"a": ShardedTensor.from_rank_offsets("a", torch.empty(8, 4), replica_id=_rank())}


def request_with_unexpected_on_rank1() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.empty(2), replica_id=1)
    return sd


def overlap_state() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(4))
    }  # every rank claims the whole tensor as main


def gap_state() -> Dict[str, Any]:
    if _rank() == 0:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, 0, 2))}
    return {}


def dtype_disagreement_state() -> Dict[str, Any]:
    dtype = torch.float32 if _rank() == 0 else torch.float16
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, dtype=dtype), (0, _rank(), 2))}


def shape_disagreement_state() -> Dict[str, Any]:
    n = 4 if _rank() == 0 else 5
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(n), (0, _rank(), 2))}


def escaping_object_state() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["obj"].key = "../../outside"  # bypasses construction-time checks on one rank only
    return sd


def none_data_on_rank1_state() -> Dict[str, Any]:
    sd = good_state()
    if _rank() == 1:
        sd["a"].data = None
    return sd


def duplicate_object_state() -> Dict[str, Any]:
    """Every rank saves the same object piece as main replica."""
    return {"obj": ShardedObject("obj", 1, (dist.get_world_size(),), (0,))}


def missing_object_state() -> Dict[str, Any]:
    """The last rank does not save its object piece: a grid cell with no main replica."""
    r, w = _rank(), dist.get_world_size()
    return {} if r == w - 1 else {"obj": ShardedObject("obj", 1, (w,), (r,))}


class CommonFailsOnRank1(TorchCommonLoadStrategy):
    """Reads the common state, except on rank 1, where it raises."""

    def load_common(self, checkpoint_dir: Any) -> Dict[str, Any]:
        if _rank() == 1:
            raise OSError("injected: common.pt unreadable on rank 1")
        return super().load_common(checkpoint_dir)


class CommonNoneOnRank1(TorchCommonLoadStrategy):
    """Reads the common state, except on rank 1, where it returns None (a broken strategy)."""

    def load_common(self, checkpoint_dir: Any) -> Any:
        return None if _rank() == 1 else super().load_common(checkpoint_dir)


def load_with_common_failing_on_rank1(ckpt: str, returns_none: bool = False) -> Any:
    strategy = CommonNoneOnRank1() if returns_none else CommonFailsOnRank1()
    return dc.load(good_state(), ckpt, common_strategy=strategy)
