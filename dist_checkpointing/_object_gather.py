"""Gathering picklable objects from every rank of a gloo group in one exchange, usually.

`torch.distributed.all_gather_object` always takes two exchanges: the sizes, then the
pickles padded to the largest. The library's own exchanges (error reports, load
statistics, read-path probes, shared-read offers) are small, and a load or save makes
several: with 4 ranks on 2 cores each exchange cost 6-7 ms, 35 ms of a 60 ms load of a
small checkpoint. Here every rank sends a fixed-size frame holding its pickle's length and
up to `inline_bytes(world)` bytes of it; only when some pickle is longer does a second
exchange carry the rest, padded to the longest rest. The frame shrinks as the world grows
(`GATHERED`), so that large jobs do not move more bytes than the objects need.

Used by `_dist.all_gather_object` for gloo groups (the library's coordination group is
one); other backends keep torch's function, which places its tensors on the right device.
"""

from __future__ import annotations

import pickle
from typing import Any, List

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["INLINE", "GATHERED", "all_gather_pickled", "inline_bytes"]

#: most pickle bytes a frame of the first exchange carries
INLINE = 16 << 10
#: bytes each rank receives in the first exchange, at most (frames x world), where frames
#: of at least `MIN_INLINE` bytes stay within it: 1 MiB, so 16 KiB frames up to 64 ranks
GATHERED = 1 << 20
#: least pickle bytes a frame carries (error reports and statistics fit)
MIN_INLINE = 256
#: the frame's leading length field (little-endian int64)
HEADER = 8


def inline_bytes(world: int) -> int:
    """Pickle bytes carried by each frame of the first exchange in a group of `world`."""
    return max(MIN_INLINE, min(INLINE, GATHERED // max(1, world) - HEADER))


def _frame(data: bytes, inline: int) -> torch.Tensor:
    frame = np.zeros(HEADER + inline, dtype=np.uint8)
    frame[:HEADER] = np.frombuffer(len(data).to_bytes(HEADER, "little"), dtype=np.uint8)
    head = data[:inline]
    frame[HEADER : HEADER + len(head)] = np.frombuffer(head, dtype=np.uint8)
    return torch.from_numpy(frame)


def all_gather_pickled(obj: Any, group: Any, world: int) -> List[Any]:
    """Collective over `group` (gloo, `world` ranks): every rank's `obj`, by group rank.

    Args:
        obj: this rank's object (picklable).
        group: the process group.
        world: its size.

    Returns:
        The unpickled objects, indexed by group rank (this rank's is a copy too, as with
        torch's function).

    Raises:
        RuntimeError: the exchange failed (a peer died or timed out).
    """
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    inline = inline_bytes(world)
    frame = _frame(data, inline)
    frames = [torch.empty_like(frame) for _ in range(world)]
    dist.all_gather(frames, frame, group=group)
    sizes = [int.from_bytes(f[:HEADER].numpy().tobytes(), "little") for f in frames]
    rest = max(sizes) - inline
    tails: List[np.ndarray] = []
    if rest > 0:  # a second exchange, of every pickle's bytes past the frame's
        tail = np.zeros(rest, dtype=np.uint8)
        extra = data[inline:]
        tail[: len(extra)] = np.frombuffer(extra, dtype=np.uint8)
        gathered = [torch.empty(rest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(gathered, torch.from_numpy(tail), group=group)
        tails = [t.numpy() for t in gathered]
    out = []
    for r, (f, n) in enumerate(zip(frames, sizes)):
        raw = f.numpy()[HEADER : HEADER + min(n, inline)].tobytes()
        if n > inline:
            raw += tails[r][: n - inline].tobytes()
        out.append(pickle.loads(raw))  # from the job's own ranks, as with torch's function
    return out
