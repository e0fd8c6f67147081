"""Rank functions for the local manager's overwrite rules (module level: sent by reference).

Two "runs" of a job save the same iteration with different states: `state(1, owner)` is
what the first run saved, `state(2, owner)` what the restarted run saves.
"""

from __future__ import annotations

import errno
import os
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from tests.local._local_fns import error_of, node_root, repl


def state(run: int, owner: int) -> BasicTensorAwareStateDict:
    """The state rank `owner` saves in `run` (distinct per run and owner)."""
    g = torch.Generator().manual_seed(100 * run + owner)
    return BasicTensorAwareStateDict(
        {"w": torch.randn(16, 5, generator=g), "meta": {"run": run, "owner": owner}}
    )


def run_of(part: BasicTensorAwareStateDict, owner: int) -> int:
    """Which run wrote `part` of `owner` (0 when it matches neither)."""
    for run in (1, 2):
        want = state(run, owner)
        if part.state_dict["meta"] == want.state_dict["meta"] and torch.equal(
            part.state_dict["w"], want.state_dict["w"]
        ):
            return run
    return 0


def manager(tmp: str, factor: int) -> LocalCheckpointManager:
    """A new manager, as a (re)started job builds it."""
    return LocalCheckpointManager(node_root(tmp), "sess", repl(1, factor))


def runs_on_disk(tmp: str, factor: int, iteration: int) -> List[Tuple[int, int]]:
    """(owner, run) of every committed part of `iteration` held here."""
    m = manager(tmp, factor)
    ids = sorted(i for i in m._my_ckpt_ids() if i[0] == iteration)
    return [(i[1], run_of(m._load(i), i[1])) for i in ids]  # type: ignore[arg-type]


def save(m: LocalCheckpointManager, run: int, iteration: int, is_async: bool) -> None:
    """Saves this rank's state of `run` as `iteration`, waiting for the commit."""
    if not is_async:
        m.save(state(run, dist.get_rank()), iteration)
        return
    queue = AsyncCallsQueue()
    try:
        req = m.save(state(run, dist.get_rank()), iteration, is_async=True)
        assert req is not None
        queue.schedule_async_request(req)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def restart_and_overwrite(tmp: str, factor: int, is_async: bool) -> Tuple[Any, ...]:
    """Run 1 saves iteration 3; a restarted run (new manager) saves 3 again.

    Returns (latest, run of the loaded state, [(owner, run) of every part on disk here]).
    """
    save(manager(tmp, factor), 1, 3, False)
    save(manager(tmp, factor), 2, 3, is_async)
    m = manager(tmp, factor)
    latest = m.find_latest()
    loaded, _ = m.load()
    return latest, run_of(loaded, dist.get_rank()), runs_on_disk(tmp, factor, 3)


def restart_and_fail(tmp: str, factor: int, phase: str, fail_rank: int) -> Tuple[Any, ...]:
    """Run 1 saves iteration 3; the restarted run's save of 3 fails on `fail_rank` in
    `phase` ('write': ENOSPC while writing; 'commit': the rename fails after other ranks'
    renames may have happened).

    Returns ((error class, message), latest after the failure, parts of 3 on disk here).
    """
    save(manager(tmp, factor), 1, 3, False)
    m = manager(tmp, factor)
    if dist.get_rank() == fail_rank:
        if phase == "write":

            def broken_write(image: Any, ckpt_id: Any) -> None:
                m._path(ckpt_id, dirty=True).write_bytes(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            m._save_image = broken_write  # type: ignore[method-assign]
        else:

            def broken_commit(ckpt_id: Any) -> None:
                raise OSError(errno.EIO, "rename failed (injected)")

            m._commit = broken_commit  # type: ignore[method-assign]
    err = error_of(m.save, state(2, dist.get_rank()), 3)
    return err, manager(tmp, factor).find_latest(), runs_on_disk(tmp, factor, 3)


def save_with_dirty_file(
    tmp: str, factor: int, planted_on: int, owner: int, when: str
) -> Tuple[Any, ...]:
    """Iteration 2 is saved; then a dirty file of iteration 3 (owner `owner`) appears on
    rank `planted_on`, before the save of 3 ('before') or while it runs ('during').

    Returns ((error class, message), planted file intact (or not planted here), latest).
    """
    m = manager(tmp, factor)
    save(m, 1, 2, False)
    here = dist.get_rank() == planted_on
    planted: Optional[str] = None
    if here:
        planted = str(m._path((3, owner, "sess"), dirty=True))
        if when == "before":
            with open(planted, "wb") as f:
                f.write(b"another writer")
        else:
            real, real_open = m._save_image, m._open_image

            def plant(ckpt_id: Any) -> None:
                if ckpt_id[1] == owner and not os.path.exists(planted):  # type: ignore[arg-type]
                    with open(planted, "wb") as f:  # type: ignore[arg-type]
                        f.write(b"another writer")

            def racing(image: Any, ckpt_id: Any) -> None:  # this rank's own part
                plant(ckpt_id)
                real(image, ckpt_id)

            def racing_open(ckpt_id: Any, nbytes: int) -> Any:  # a replica, as it arrives
                plant(ckpt_id)
                return real_open(ckpt_id, nbytes)

            m._save_image = racing  # type: ignore[method-assign]
            m._open_image = racing_open  # type: ignore[method-assign]
    err = error_of(m.save, state(2, dist.get_rank()), 3)
    intact = True
    if here and when == "before":
        with open(planted, "rb") as f:  # type: ignore[arg-type]
            intact = f.read() == b"another writer"
    return err, intact, manager(tmp, factor).find_latest()
