"""Rank functions for the streamed-recovery tests (module level: sent to worker ranks)."""

from __future__ import annotations

import errno
import os
from typing import List, Optional, Tuple

import torch.distributed as dist

from dist_checkpointing.local.replication import strategies
from dist_checkpointing.storage import faults
from tests.local import _local_fns as F


def recover_with_spy(tmp: str, chunk: int, factor: int) -> Tuple[bool, List[Tuple[int, int]], int]:
    """Loads after the last rank lost its directory, parts streamed in `chunk`-byte pieces.

    Returns:
        (state equal to the saved one, the (offset, nbytes) reads of the lost part's file
        made here, that file's size here or -1 when this rank holds no copy).
    """
    strategies.TRANSFER_CHUNK = chunk
    lost = dist.get_world_size() - 1
    m = F.manager(tmp, 1, factor)
    held = os.listdir(m.local_ckpt_dir) if m.local_ckpt_dir.is_dir() else []
    names = [n for n in held if f"_{lost}_local.pt" in n]
    size = os.path.getsize(m.local_ckpt_dir / names[0]) if names else -1
    spy = faults.Fault(f"*_{lost}_local.pt", ops=("read",))
    with faults.injected(spy):
        it, same, _ = F.load_latest(tmp, 1, factor)
    reads = [(c.offset, c.nbytes) for c in spy.calls]
    return same and it == 3, reads, size


def recover_past_a_bad_copy(tmp: str, damage: str) -> Tuple[bool, Optional[str]]:
    """Rank 3 lost its directory; rank 0's copy of part 3 (picked first) is damaged; the
    load must use another holder's copy. Returns (state equal, None)."""
    if damage == "flip":
        F.flip_byte(tmp, 0, 3, 100)
    fault = faults.Fault(
        "*_3_local.pt", ops=("read",), error=OSError(errno.EIO, "injected read error")
    )
    if damage == "read_error" and dist.get_rank() == 0:
        faults.inject(fault)
    try:
        it, same, _ = F.load_latest(tmp, 1, 4)
    finally:
        faults.remove(fault)
    return same and it == 3, None
