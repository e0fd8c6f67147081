"""Rank functions of `test_ownership.py` (module level: sent to worker ranks by reference)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.storage import faults
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

#: what a trial's rank reports: ('', '') for success, else (exception class, message)
Result = Tuple[str, str]


def state(job: int, trial: int, fill: bool = True) -> Dict[str, Any]:
    """A small state whose every value tells which job and trial saved it."""
    r, w = dist.get_rank(), dist.get_world_size()
    full = torch.arange(4 * 2 * w, dtype=torch.float32).reshape(4, 2 * w) + 1000 * job + trial
    local = full[:, 2 * r : 2 * r + 2].clone()
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", local if fill else torch.zeros_like(local), (1, r, w)
        ),
        "o": ShardedObject(
            "o", {"job": job, "trial": trial, "rank": r} if fill else None, (w,), (r,)
        ),
        "who": (job, trial),
    }


def holds(ckpt: str, job: int, trial: int) -> bool:
    """Whether `ckpt` loads exactly as `state(job, trial)` (every value)."""
    want = state(job, trial)
    got = dc.load(state(job, trial, fill=False), ckpt)
    return bool(
        torch.equal(got["w"], want["w"].data)
        and got["o"] == want["o"].data
        and tuple(got["who"]) == (job, trial)
    )


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> Result:
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


def _rendezvous(base: str, trial: int, job: int) -> None:
    """Both jobs' ranks 0 meet (through files), then each job's ranks: the saves start together."""
    if dist.get_rank() == 0:
        open(os.path.join(base, f"ready_{trial}_{job}"), "w").close()
        other = os.path.join(base, f"ready_{trial}_{1 - job}")
        deadline = time.monotonic() + 30
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.0005)
    dist.barrier()


def race(base: str, job: int, trials: int, strategy: Any = None) -> List[Result]:
    """Job `job` saves `state(job, i)` into `base/t<i>` for each trial, started together with
    the other job (a random delay of up to 20 ms per rank and trial, both jobs' drawn apart),
    with the save strategy `strategy` (None: the default)."""
    results = []
    for i in range(trials):
        _rendezvous(base, i, job)
        time.sleep(random.Random(f"{i}/{job}/{dist.get_rank()}").uniform(0, 0.02))
        ckpt = os.path.join(base, f"t{i}")
        results.append(_attempt(dc.save, state(job, i), ckpt, sharded_strategy=strategy))
    return results


def winners_hold(base: str, winners: List[int]) -> List[bool]:
    """Per trial, whether its directory loads exactly as its winner's state."""
    return [holds(os.path.join(base, f"t{i}"), job, i) for i, job in enumerate(winners)]


def _digests(ckpt: str) -> Dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(ckpt, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(ckpt))
    }


def save_into_links(tmp: str, kind: str, link_claim: bool) -> Tuple[bool, Result, bool, bool]:
    """Saves A; rank 0 fills T with `kind` links to A's files (all but metadata.json, and
    claim.json only with `link_claim`); then every rank saves another state into T.

    Returns `(A's bytes unchanged, T's save outcome, A loads exactly, T loads exactly)`.
    """
    a, t = os.path.join(tmp, f"A-{kind}-{link_claim}"), os.path.join(tmp, f"T-{kind}-{link_claim}")
    dc.save(state(0, 1), a)
    dist.barrier()
    if dist.get_rank() == 0:
        os.makedirs(t)
        for name in os.listdir(a):
            if name == "metadata.json" or (name == "claim.json" and not link_claim):
                continue
            link = os.symlink if kind == "symlink" else os.link
            link(os.path.join(a, name), os.path.join(t, name))
    before = _digests(a)
    dist.barrier()
    outcome = _attempt(dc.save, state(1, 2), t)
    dist.barrier()
    t_ok = outcome == ("", "") and holds(t, 1, 2)
    return _digests(a) == before, outcome, holds(a, 0, 1), t_ok


def die_after_commit(tmp: str, victim: int, is_async: bool) -> Tuple[str, str, float]:
    """`victim` is SIGKILLed as soon as the commit marker appears; rank 0 (which wrote it)
    lingers a moment after writing it, so the victim dies before the closing agreement.
    Returns the survivor's `(exception class, message, seconds from the marker)`. In
    worlds of more than 2 ranks the collective timeout is 5 s: ranks that are not next to
    the victim in the closing agreement only notice the loss by that timeout."""
    if dist.get_world_size() > 2:
        dc.set_collective_timeout(5)
    ckpt = os.path.join(tmp, "K")
    marker = os.path.join(ckpt, "metadata.json")
    seen: List[float] = []
    if dist.get_rank() == victim:

        def watch() -> None:
            while not os.path.exists(marker):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    else:
        faults.inject(faults.Fault("metadata.json", ops=("replaced",), delay_s=1.0))
    try:
        if is_async:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(dc.save(state(0, 3), ckpt, async_sharded_save=True))
            name, message = _attempt(queue.maybe_finalize_async_calls, True)
        else:
            name, message = _attempt(dc.save, state(0, 3), ckpt)
    finally:
        seen.append(os.path.getmtime(marker) if os.path.exists(marker) else time.time())
    return name, message, time.time() - seen[0]


def loads_after_commit(tmp: str) -> bool:
    return holds(os.path.join(tmp, "K"), 0, 3)


def full_disk_leaves_nothing(tmp: str, victim: int, is_async: bool) -> Tuple[str, List[str]]:
    """`victim`'s data files hit ENOSPC; returns (the error class, what is left in the dir)."""
    ckpt = os.path.join(tmp, f"F-{is_async}")
    full = faults.Fault("*.distcp", error=OSError(errno.ENOSPC, "No space left on device"))
    with faults.injected(*([full] if dist.get_rank() == victim else [])):
        if is_async:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(dc.save(state(0, 4), ckpt, async_sharded_save=True))
            name, _ = _attempt(queue.maybe_finalize_async_calls, True)
        else:
            name, _ = _attempt(dc.save, state(0, 4), ckpt)
    dist.barrier()
    left = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    dist.barrier()
    # the directory is free again: a new save there succeeds
    dc.save(state(0, 5), ckpt)
    return name, left if holds(ckpt, 0, 5) else ["<the next save did not load>"]


def save_a_list(tmp: str) -> Result:
    return _attempt(dc.save, [state(0, 6)], os.path.join(tmp, "L"))


def claimed_by_hand(tmp: str) -> Result:
    """A directory whose claim names a process that no longer runs: reported, not taken."""
    ckpt = os.path.join(tmp, "S")
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
        with open(os.path.join(ckpt, "claim.json"), "w") as f:
            claim = {"format": 1, "host": socket.gethostname(), "pid": _dead_pid()}
            claim.update(time="2026-01-01T00:00:00+00:00", token="0123456789abcdef" * 2)
            json.dump(claim, f)
    dist.barrier()
    return _attempt(dc.save, state(0, 7), ckpt)


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def noop(*_: Optional[Any]) -> None:
    return None


def die_while_writer_runs(tmp: str, victim: int) -> Tuple[str, str, float]:
    """`victim`'s async writer hangs in its first write (a stuck disk) and `victim` is then
    SIGKILLed; returns the survivor's `(exception class, message, seconds after the kill)`."""
    if dist.get_rank() == victim:  # the forked writer inherits the fault
        faults.inject(faults.Fault("*.distcp", delay_s=120))
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        dc.save(state(0, 8), os.path.join(tmp, "W"), async_sharded_save=True)
    )
    time.sleep(1.0)  # the writer is in its write
    killed_at = time.time()
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    name, message = _attempt(queue.maybe_finalize_async_calls, True)
    return name, message, time.time() - killed_at


def die_before_first_collective(tmp: str, victim: int) -> Tuple[str, str, float]:
    """`victim` dies before the library's coordination group exists (a new timeout makes
    the next collective create it); returns the survivor's `(class, message, seconds)`."""
    dc.set_collective_timeout(5)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.time()
    name, message = _attempt(dc.save, state(0, 9), os.path.join(tmp, "G"))
    return name, message, time.time() - start
