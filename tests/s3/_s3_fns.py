"""Functions the 2-rank gloo world runs against the loopback S3 server."""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor


def use(environment: Dict[str, str]) -> None:
    os.environ.update(environment)


def state(step: int) -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    full = torch.arange(64 * w, dtype=torch.float32).reshape(8, 8 * w) + step
    return {
        "w": ShardedTensor.from_rank_offsets("w", full[:, r * 8 : (r + 1) * 8].clone(), (1, r, w)),
        "o": ShardedObject("rng", {"rank": r, "step": step}, (w,), (r,)),
        "step": step,
    }


def save(environment: Dict[str, str], url: str, step: int, async_save: bool = False) -> None:
    use(environment)
    request = dc.save(state(step), url, async_sharded_save=async_save)
    if request is not None:
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()


def load(environment: Dict[str, str], url: str) -> Any:
    use(environment)
    request = state(0)
    request["w"].data.zero_()
    request["o"].data = None
    out = dc.load(request, url)
    return out["w"].clone(), out["o"], out["step"], dc.load_common_state_dict(url)


def save_expecting_error(environment: Dict[str, str], url: str) -> str:
    """Saves; returns the error message this rank got (every rank must get one)."""
    try:
        save(environment, url, 1)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def big(step: int, fill: bool = True) -> Dict[str, Any]:
    """12 MiB per rank: with 5 MiB parts, each rank's data object is a 3-part upload."""
    r, n = dist.get_rank(), 3 << 20
    t = torch.full((n,), float(step + r)) if fill else torch.zeros(n)
    return {
        "w": ShardedTensor.from_rank_offsets("w", t, (0, r, dist.get_world_size())),
        "step": step,
    }


def save_big(environment: Dict[str, str], url: str, step: int) -> str:
    """Saves `big(step)`; returns this rank's error ("" if none)."""
    use(environment)
    try:
        dc.save(big(step), url)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def after_kill(environment: Dict[str, str], root: str) -> Tuple[bool, str, bool, bool]:
    """After a rank died saving step 2 under `root`: (step 2 is not a checkpoint, the error
    loading it, step 1 loads exactly, step 3 saves and loads)."""
    use(environment)

    def loads(url: str, step: int) -> bool:
        got = dc.load(big(step, fill=False), url)
        return torch.equal(got["w"], big(step)["w"].data) and got["step"] == step

    error = ""
    try:
        dc.load(big(2, fill=False), f"{root}/iter_0000002")
    except Exception as e:
        error = type(e).__name__
    b_is_ckpt = dc.check_is_distributed_checkpoint(f"{root}/iter_0000002")
    dc.save(big(3), f"{root}/iter_0000003")
    return not b_is_ckpt, error, loads(f"{root}/iter_0000001", 1), loads(f"{root}/iter_0000003", 3)
