"""Rank functions for the durability tests: crashes simulated by leaving the files a crash
leaves (a torn committed part, a missing one, a truncated `.dirty` part of the next save)."""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

from ._local_fns import error_of, node_root, repl


def _state(iteration: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(100 * iteration + dist.get_rank())
    return {
        "w": torch.randn(300, 70, generator=g),
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "step": iteration,
    }


def _manager(tmp: str, fsync: bool, factor: int) -> LocalCheckpointManager:
    return LocalCheckpointManager(node_root(tmp), "d", repl(1, factor), fsync=fsync)


def crash_after_commit(tmp: str, fsync: bool, factor: int, damage: str) -> Tuple[str, str]:
    """Saves iterations 1 and 2, then leaves what a crash of rank 1's machine can leave:
    its committed part of 2 torn (truncated) or missing, and a truncated `.dirty` part of
    iteration 3. A fresh manager (the restarted job) loads.

    Returns:
        ('', '') when every rank got its exact state of iteration 2, else the error.
    """
    m = _manager(tmp, fsync, factor)
    for it in (1, 2):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
    dist.barrier()
    if dist.get_rank() == 1:
        part = m._path((2, 1, "d"))
        data = part.read_bytes()
        m._path((3, 1, "d"), dirty=True).write_bytes(data[: len(data) // 3])
        if damage == "torn":
            os.truncate(part, len(data) // 2)
        else:
            part.unlink()
    dist.barrier()

    def load() -> None:
        fresh = _manager(tmp, fsync, factor)
        latest = fresh.find_latest()
        state, ckpt_id = fresh.load()
        assert latest == 2  # the dirty part of 3 never counts
        want = _state(2)
        got = state.state_dict
        assert ckpt_id == (2, dist.get_rank(), "d")
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["h"], want["h"])
        assert got["step"] == 2

    return error_of(load)


def fsync_calls(tmp: str, fsync: Any, factor: int) -> Tuple[bool, int]:
    """(the manager's policy, os.fsync calls during three saves).

    The second and third saves recycle the parts they supersede (renames) and remove the
    rest: without the policy's fsync, that cleanup must not fsync the directory either.
    """
    m = LocalCheckpointManager(node_root(tmp), "f", repl(1, factor), fsync=fsync)
    calls = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    os.fsync = counting  # type: ignore[assignment]
    try:
        for iteration in (1, 2, 3):
            m.save(BasicTensorAwareStateDict(_state(iteration)), iteration)
    finally:
        os.fsync = real  # type: ignore[assignment]
    assert any(p.name.startswith("spare_") for p in m.local_ckpt_dir.iterdir())
    return m.fsync, len(calls)
