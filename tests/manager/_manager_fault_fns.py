"""Rank functions: a background (async) save that fails inside the manager (importable by
worker ranks)."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, CheckpointManagerOptions
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.manager.layout import read_latest
from dist_checkpointing.storage import faults
from tests.manager._manager_fns import _state


def _steps(root: Path) -> List[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_"))


def _load_newest(root: Path) -> int:
    """A restarted job: loads the newest usable checkpoint, checks its values."""
    manager = CheckpointManager(root, CheckpointManagerOptions(save_interval=2))
    try:
        state, step = manager.load(_state(0))
    finally:
        manager.close()
    assert torch.equal(state["w"], _state(step)["w"].data), step
    return step


def failing_background_write(base: str, on_error: str, where: str) -> Dict[str, Any]:
    """Steps 1..3 saved (step 2 committed); the last rank's background write of step 4 fails
    (ENOSPC, injected into the forked writer); the failure shows at `where` ('save': a
    later `save`, 'finalize': `wait_until_finished`, 'close': `close`); then training goes
    on to step 10 (unless the manager was closed) and a restarted job loads.

    Returns what this rank saw.
    """
    root = Path(base)
    rank, victim = dist.get_rank(), dist.get_world_size() - 1
    options = CheckpointManagerOptions(save_interval=2, keep_last=2, on_error=on_error)
    manager = CheckpointManager(root, options)
    for step in range(1, 4):
        manager.save(step, _state(step))
    manager.wait_until_finished()
    fault: Optional[faults.Fault] = None
    if rank == victim:  # installed before the writer forks, so only its writer fails
        fault = faults.inject(
            faults.Fault("*/iter_0000004/*", error=OSError(errno.ENOSPC, "No space left"))
        )
    try:
        assert manager.save(4, _state(4)) is True  # returns at once; the write fails later
    finally:
        if fault is not None:
            faults.remove(fault)
    seen: Dict[str, Any] = {"raised_at": None, "error": ""}
    step = 4
    try:
        if where == "save":
            deadline = time.monotonic() + 120
            # every rank notices in the same call (the failure is agreed on)
            while not manager.failed_saves and time.monotonic() < deadline:
                step += 1
                manager.save(step, _state(step))
                time.sleep(0.1)
        elif where == "finalize":
            manager.wait_until_finished()
        else:
            manager.close()
    except CheckpointingException as e:
        seen["raised_at"] = where
        seen["error"] = str(e)
    seen["latest_after_failure"] = read_latest(root)
    seen["steps_after_failure"] = _steps(root)
    seen["failed_saves"] = [s for s, _ in manager.failed_saves]
    if where != "close":  # training goes on: the next due saves run normally
        for later in range(step + 1, 11):
            manager.save(later, _state(later))
        manager.close()
    dist.barrier()
    seen["last_step"] = max(step, 10) if where != "close" else 4
    seen["latest_final"] = read_latest(root)
    seen["steps_final"] = _steps(root)
    seen["loaded"] = _load_newest(root)
    return seen


def failing_local_background_write(base: str, on_error: str) -> Dict[str, Any]:
    """Local tier only (every 2 steps): the last rank's background write of step 4's part
    fails (ENOSPC); noticed at a later `save`; training goes on to step 8; a restart loads.

    Returns what this rank saw.
    """
    root, local_root = Path(base) / "p", Path(base) / "l"
    rank, victim = dist.get_rank(), dist.get_world_size() - 1
    options = CheckpointManagerOptions(
        save_interval=1000, local_root=local_root, local_save_interval=2, on_error=on_error
    )
    manager = CheckpointManager(root, options)
    for step in range(1, 4):
        manager.save(step, _state(step))
    manager.wait_until_finished()
    fault: Optional[faults.Fault] = None
    if rank == victim:  # the local writer is a thread of this process: keep it until noticed
        fault = faults.inject(
            faults.Fault("*iter_0000004_*", error=OSError(errno.ENOSPC, "No space left"))
        )
    seen: Dict[str, Any] = {"raised": ""}
    step = 3
    try:
        deadline = time.monotonic() + 120
        while not manager.failed_saves and time.monotonic() < deadline:
            step += 1
            manager.save(step, _state(step))
            time.sleep(0.1)
    except CheckpointingException as e:
        seen["raised"] = str(e)
    finally:
        if fault is not None:
            faults.remove(fault)
    mine = local_root / "dist_ckpt" / str(rank)
    seen["parts_after_failure"] = sorted(p.name for p in mine.iterdir())
    seen["failed_saves"] = [s for s, _ in manager.failed_saves]
    for later in range(step + 1, 9):
        manager.save(later, _state(later))
    manager.close()
    dist.barrier()
    restarted = CheckpointManager(root, options)
    state, loaded = restarted.load(_state(0))
    restarted.close()
    assert torch.equal(state["w"], _state(loaded)["w"].data)
    seen["loaded"] = (loaded, restarted.last_restore.tier if restarted.last_restore else "")
    return seen
