"""Rank functions for the MCoreTensorAwareStateDict tests (module level: sent by reference)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing import LocalNonpersistentObject, ShardedObject, ShardedTensor
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy
from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict


def model_state(fill: bool = True, extra: bool = False) -> Dict[str, Any]:
    """Per rank: a tensor replicated on every rank (data parallel), one split on rows
    (tensor parallel), a replicated ShardedObject, plain values and a non-persistent value."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def data(t: torch.Tensor) -> torch.Tensor:
        return t if fill else torch.zeros_like(t)

    emb = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    rows = torch.arange(4 * 6, dtype=torch.bfloat16).reshape(4, 6) + rank
    sd: Dict[str, Any] = {
        "model": {
            # replica_id = rank: every rank holds the same shard
            "emb": ShardedTensor.from_rank_offsets("emb", data(emb), replica_id=rank),
            "layers": [
                ShardedTensor.from_rank_offsets(
                    f"layer{i}", data(rows * (i + 1)), (0, rank, world), replica_id=0
                )
                for i in range(3)
            ]
            + [
                ShardedTensor.from_rank_offsets(
                    f"norm{i}", data(torch.full((16,), float(i))), replica_id=rank
                )
                for i in range(4)
            ],
        },
        "rng": ShardedObject("rng", {"seed": 1234}, (1,), (0,), replica_id=rank),
        "iteration": 7,
        "note": "hello",
        "scratch": LocalNonpersistentObject(f"rank{rank}"),
    }
    if extra:
        sd["model"]["never_saved"] = ShardedTensor.from_rank_offsets(
            "never_saved", torch.zeros(2), replica_id=rank
        )
    return sd


def _expected(sd: Dict[str, Any]) -> Dict[str, Any]:
    m = sd["model"]
    return {
        "emb": m["emb"].data,
        "layers": [x.data for x in m["layers"]],
    }


def round_trip(tmp: str, algo: str, is_async: bool) -> Tuple[List[str], int, bool, bool]:
    """Saves through the local manager with `algo`, loads back, checks values.

    Returns:
        (names of the tensors this rank stored, bytes it stored, whether the loaded state
        equals the saved one, whether the caller's state kept its tensors).
    """
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    rank = dist.get_rank()
    root = os.path.join(tmp, f"node{rank}")
    sd = model_state()
    tasd, dist_md = MCoreTensorAwareStateDict.from_state_dict(sd, algo=algo)
    stored = tasd.tensor_names()
    nbytes = sum(t.numel() * t.element_size() for t in tasd.tensors)
    if algo == "fully_parallel":
        # the cache gives the same split without an exchange
        again, same = MCoreTensorAwareStateDict.from_state_dict(
            sd, algo=algo, cached_metadata=dist_md
        )
        assert same is dist_md and again.tensor_names() == stored
    repl = CliqueReplicationStrategy.from_replication_params(1, 2)
    mgr = LocalCheckpointManager(root, repl_strategy=repl)
    if is_async:
        q = AsyncCallsQueue()
        q.schedule_async_request(mgr.save(tasd, 1, is_async=True))
        q.maybe_finalize_async_calls(blocking=True)
        q.close()
    else:
        mgr.save(tasd, 1)
    kept = all(
        isinstance(x.data, torch.Tensor) for x in sd["model"]["layers"] + [sd["model"]["emb"]]
    )
    fresh = LocalCheckpointManager(root, repl_strategy=repl)
    assert fresh.find_latest() == 1
    loaded, _ = fresh.load()
    out = loaded.to_state_dict(model_state(fill=False), algo=algo)
    exp = _expected(model_state())
    ok = (
        torch.equal(out["model"]["emb"], exp["emb"])
        and all(torch.equal(a, b) for a, b in zip(out["model"]["layers"], exp["layers"]))
        and out["model"]["layers"][3].dtype == torch.float32
        and out["rng"] == {"seed": 1234}
        and (out["iteration"], out["note"], out["scratch"]) == (7, "hello", f"rank{rank}")
    )
    return stored, nbytes, ok, kept


def missing_shard_error(tmp: str) -> Tuple[str, str]:
    """Saves fully parallel, then asks for a tensor nobody stored."""
    rank = dist.get_rank()
    root = os.path.join(tmp, f"node{rank}")
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(model_state(), algo="fully_parallel")
    mgr = LocalCheckpointManager(root)
    mgr.save(tasd, 1)
    loaded, _ = LocalCheckpointManager(root).load()
    try:
        loaded.to_state_dict(model_state(fill=False, extra=True), algo="fully_parallel")
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""
