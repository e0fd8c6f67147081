"""Rank functions of the fault tests (module level: sent to worker ranks by reference)."""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.storage import faults
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue


def state(step: int, fill: bool = True) -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    full = torch.randn(64, 16 * w, generator=g)
    local = full[:, r * 16 : (r + 1) * 16].clone()
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", local if fill else torch.zeros_like(local), (1, r, w)
        ),
        "o": ShardedObject("o", {"r": r, "step": step} if fill else None, (w,), (r,)),
        "step": step,
    }


def loads_exactly(ckpt: str, step: int) -> bool:
    want = state(step)
    got = dc.load(state(step, fill=False), ckpt)
    return bool(
        torch.equal(got["w"], want["w"].data) and got["o"] == want["o"].data and got["step"] == step
    )


def outcome(fn: Any, *args: Any) -> Tuple[str, str, float]:
    """(exception class, message, seconds until it raised), or ('', '', seconds)."""
    t0 = time.monotonic()
    try:
        fn(*args)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "", "", time.monotonic() - t0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_during_save(tmp: str, victim: int, is_async: bool) -> Tuple[str, str, float]:
    """Saves A completely, then B while `victim` is SIGKILLed in the middle of it."""
    dc.save(state(1), os.path.join(tmp, "A"))
    me = dist.get_rank()
    b = os.path.join(tmp, "B")
    if not is_async:
        if me == victim:  # its data file is cut off after 4096 bytes by its death
            faults.inject(faults.Fault("*.distcp", die_after_bytes=4096))
        return outcome(dc.save, state(2), b)
    queue = AsyncCallsQueue()
    if me == victim:  # the forked writer inherits the fault: a slow disk
        faults.inject(faults.Fault("*.distcp", delay_s=3))
    req = dc.save(state(2), b, async_sharded_save=True)
    queue.schedule_async_request(req)
    if me == victim:
        time.sleep(1.0)  # the writer is mid-save
        _die()
    return outcome(queue.maybe_finalize_async_calls, True)


def after_crash(tmp: str) -> Tuple[bool, bool, str, bool]:
    """In a fresh world: B is not a checkpoint, A loads bit-exactly, a new save works."""
    b = os.path.join(tmp, "B")
    not_ckpt = not dc.check_is_distributed_checkpoint(b)
    err = outcome(dc.load, state(2, fill=False), b)[0]
    a_ok = loads_exactly(os.path.join(tmp, "A"), 1)
    c = os.path.join(tmp, "C")
    dc.save(state(3), c)
    return not_ckpt, a_ok, err, loads_exactly(c, 3)


def local_crash(tmp: str, victim: int) -> Tuple[str, str, float]:
    """Local checkpoints: iteration 1 committed, then the victim dies during iteration 2."""
    m = LocalCheckpointManager(os.path.join(tmp, f"node{dist.get_rank()}"), "s")
    sd = BasicTensorAwareStateDict({"t": torch.arange(1000.0) + dist.get_rank()})
    m.save(sd, 1)
    if dist.get_rank() == victim:
        m._save_image = lambda *a: (time.sleep(0.5), _die())  # type: ignore[method-assign]
    queue = AsyncCallsQueue()
    queue.schedule_async_request(m.save(sd, 2, is_async=True))
    return outcome(queue.maybe_finalize_async_calls, True)


def local_after_crash(tmp: str) -> Tuple[int, bool, int]:
    m = LocalCheckpointManager(os.path.join(tmp, f"node{dist.get_rank()}"), "s")
    latest = m.find_latest()
    got, _ = m.load()
    ok = torch.equal(got["t"], torch.arange(1000.0) + dist.get_rank())
    m.save(BasicTensorAwareStateDict({"t": torch.zeros(3)}), 3)
    return (
        latest,
        ok,
        LocalCheckpointManager(os.path.join(tmp, f"node{dist.get_rank()}"), "s").find_latest(),
    )


def stuck_rank_save(tmp: str, stuck: int, timeout_s: float) -> Tuple[str, str, float]:
    """`stuck` hangs (alive) in its write; the others must fail within the timeout."""
    dc.set_collective_timeout(timeout_s)
    if dist.get_rank() == stuck:  # a hung disk: the write starts only after 3 timeouts
        faults.inject(faults.Fault("*.distcp", delay_s=timeout_s * 3))
    return outcome(dc.save, state(1), os.path.join(tmp, "S"))


def enospc_on_rank(tmp: str, victim: int) -> Tuple[str, str, float]:
    full = faults.Fault("*.distcp", error=OSError(errno.ENOSPC, "No space left on device"))
    # removed again after the save: the world serves the next tests
    with faults.injected(*([full] if dist.get_rank() == victim else [])):
        return outcome(dc.save, state(1), os.path.join(tmp, "F"))


def corrupt_and_load(tmp: str, owner: int) -> Tuple[str, str, float]:
    """Saves, flips one byte in `owner`'s data file, and loads with every rank reading its own part."""
    ckpt = os.path.join(tmp, "X")
    dc.save(state(1), ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        name = sorted(
            n
            for n in os.listdir(ckpt)
            if n.startswith(f"__{owner}_") and os.path.getsize(os.path.join(ckpt, n))
        )[0]
        path = os.path.join(ckpt, name)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    return outcome(dc.load, state(1, fill=False), ckpt)
