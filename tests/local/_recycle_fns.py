"""Rank functions for the recycled-part tests: superseded parts kept as spares and written
over by the next save, and what a crash during or after such an overwrite leaves."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

from ._local_fns import error_of, node_root, repl

#: elements of the main tensor per iteration: smaller and larger than the recycled files
_SIZES = {1: 50_000, 2: 50_000, 3: 10_000, 4: 90_000, 5: 50_000}


def _state(iteration: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(100 * iteration + dist.get_rank())
    return {
        "w": torch.randn(_SIZES[iteration], generator=g),
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "step": iteration,
    }


def _manager(tmp: str, factor: int, fsync: Any = None) -> LocalCheckpointManager:
    return LocalCheckpointManager(node_root(tmp), "r", repl(1, factor), fsync=fsync)


def _exact(state: Any, iteration: int) -> bool:
    want, got = _state(iteration), state.state_dict
    return (
        torch.equal(got["w"], want["w"])
        and torch.equal(got["h"], want["h"])
        and got["step"] == iteration
    )


def _inodes(m: LocalCheckpointManager, iteration: int) -> List[int]:
    return [os.stat(p).st_ino for i, dirty, p in m._scan() if i[0] == iteration and not dirty]


def saves_write_over_spares(tmp: str, factor: int) -> Tuple[bool, bool, List[int], bool]:
    """Saves iterations 1-4 (sizes vary), then loads each newest one with a fresh manager.

    Returns:
        (the files of iteration 3 are iteration 1's, recycled; every load was exact; the
        number of spares after each save; the parts' sizes follow their states').
    """
    m = _manager(tmp, factor)
    spares, exact, inodes, sizes = [], True, {}, {}
    for it in (1, 2, 3, 4):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
        inodes[it] = _inodes(m, it)
        sizes[it] = m._path((it, dist.get_rank(), "r")).stat().st_size
        spares.append(len(m._spares()))
        dist.barrier()
        fresh = _manager(tmp, factor)
        state, ckpt_id = fresh.load()
        exact = exact and ckpt_id == (it, dist.get_rank(), "r") and _exact(state, it)
        del state  # its tensors map the part: kept, they would keep it from being recycled
        dist.barrier()
    recycled = sorted(inodes[3]) == sorted(inodes[1])
    # iteration 3 is smaller than the file it was written over: truncated to its size
    sizes_ok = sizes[3] < sizes[1] < sizes[4]
    return recycled, exact, spares, sizes_ok


def committed_part_holds_older_bytes(
    tmp: str, factor: int, fsync: bool, how: str
) -> Tuple[str, str]:
    """What a machine crash can leave when a recycled file's overwrite never reached the
    disk but its rename did (no fsync): rank 1's committed part of iteration 3 holds, wholly
    (`how='old'`) or past its first half (`how='mixed'`), the bytes of its part of
    iteration 1, with valid checksums. A fresh manager (the restarted job) loads.

    Returns:
        ('', '') when every rank got its exact state of iteration 3, else the error.
    """
    m = _manager(tmp, factor, fsync)
    m.save(BasicTensorAwareStateDict(_state(1)), 1)
    old = m._path((1, dist.get_rank(), "r")).read_bytes()
    for it in (2, 3):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
    dist.barrier()
    if dist.get_rank() == 1:
        part = m._path((3, 1, "r"))
        new = part.read_bytes()
        torn = old if how == "old" else new[: len(new) // 2] + old[len(new) // 2 :]
        part.write_bytes(torn)
    dist.barrier()

    def load() -> None:
        fresh = _manager(tmp, factor, fsync)
        assert fresh.find_latest() == 3
        state, ckpt_id = fresh.load()
        assert ckpt_id == (3, dist.get_rank(), "r")
        assert _exact(state, 3)

    return error_of(load)


def crash_while_writing_over_a_spare(tmp: str) -> Tuple[int, bool, str, bool, List[str]]:
    """Saves 1 and 2; rank 1 then dies part-way through writing its part of 3 over a spare
    (the spare moved to the dirty name, its first bytes overwritten), and a process that
    died while moving a spare left its claim file. The restarted job loads, saves 3 again,
    saves 4 and loads.

    Returns:
        (latest iteration found, that load exact, the error of saving 3 again, the load
        after saving 4 exact, the leftover files on this rank after saving 4).
    """
    m = _manager(tmp, 2)
    for it in (1, 2):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
    dist.barrier()
    if dist.get_rank() == 1:
        dirty = m._path((3, 1, "r"), dirty=True)
        assert m._claim_spare(dirty)
        fd = os.open(dirty, os.O_WRONLY)
        os.pwrite(fd, b"\x5a" * 4096, 0)
        os.close(fd)
        (m.local_ckpt_dir / "claim_999999999_1.bin").write_bytes(b"x" * 100)
    dist.barrier()
    fresh = _manager(tmp, 2)
    latest = fresh.find_latest()
    state, _ = fresh.load()
    first = _exact(state, 2)
    again = error_of(fresh.save, BasicTensorAwareStateDict(_state(3)), 3)[0]
    fresh.save(BasicTensorAwareStateDict(_state(4)), 4)
    dist.barrier()
    state, _ = _manager(tmp, 2).load()
    left = sorted(
        n for n in os.listdir(fresh.local_ckpt_dir) if not n.startswith(("iter_0000004_", "spare_"))
    )
    return latest, first, again, _exact(state, 4), left


def loaded_tensors_outlive_later_saves(tmp: str, factor: int) -> Tuple[bool, bool, bool, bool]:
    """Saves 1 and 2, loads 2 and keeps its tensors (writing into one), then saves 3, 4 and
    5, whose clean-ups recycle superseded parts and write over them.

    Returns:
        (a second load of 2 did not see the write; the kept tensors still hold 2's values
        and the write, after the later saves; the part they map was not written over; a
        fresh load of 5 is exact).
    """
    m = _manager(tmp, factor)
    for it in (1, 2):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
    kept = _manager(tmp, factor).load()[0].state_dict
    kept["w"][0] = 123.0  # the user's write: private to these tensors, not the file's
    again = _manager(tmp, factor).load()[0]
    unchanged = _exact(again, 2)
    del again
    kept_inode = os.stat(m._path((2, dist.get_rank(), "r"))).st_ino  # the part `kept` maps
    later: set = set()
    for it in (3, 4, 5):
        m.save(BasicTensorAwareStateDict(_state(it)), it)
        later.update(_inodes(m, it))
    want = _state(2)
    still = (
        float(kept["w"][0]) == 123.0
        and torch.equal(kept["w"][1:], want["w"][1:])
        and torch.equal(kept["h"], want["h"])
    )
    return unchanged, still, kept_inode not in later, _exact(_manager(tmp, factor).load()[0], 5)
