"""Many ranks of a coordination protocol in one process, in lockstep: the package's real
protocols (`dist_checkpointing.coordination`), each rank's CPU time and what each exchange
delivers. Used by the scale tests and `benchmarks/bench_scale.py`."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, List, Sequence, Tuple

from dist_checkpointing.coordination import AllToAll, Protocol, deliver

__all__ = ["Exchange", "SimStats", "simulate"]


@dataclass
class Exchange:
    """One simulated exchange: what the rank that received most got, and the total."""

    op: str
    max_recv_bytes: int
    max_recv_messages: int
    total_bytes: int


@dataclass
class SimStats:
    """What `simulate` measured: each rank's CPU seconds, and every exchange."""

    cpu_s: List[float]
    exchanges: List[Exchange] = field(default_factory=list)

    @property
    def max_recv_bytes(self) -> int:
        """The most any rank received in any one exchange."""
        return max((e.max_recv_bytes for e in self.exchanges), default=0)


def _received(result: Any, world: int, all_to_all: bool) -> Tuple[int, int]:
    """(bytes, messages) a rank received as `result` of one operation."""
    if result is None:
        return 0, 0
    if isinstance(result, tuple):  # a sum: 8 bytes a lane
        return 8 * len(result), 1
    if isinstance(result, bytes):
        return len(result), 1
    parts = list(result.values()) if isinstance(result, dict) else list(result)
    size = sum(len(p) for p in parts)
    return (size + 8 * world, len(parts)) if all_to_all else (size, len(parts))


def simulate(
    protocols: Sequence[Protocol[Any]], *, return_exceptions: bool = False
) -> Tuple[List[Any], SimStats]:
    """Runs one protocol per simulated rank (rank = position) in lockstep, in this process.

    An all-to-all also counts, for every rank, one 8-byte size from each peer (as any
    all-to-all must send).

    Args:
        protocols: one started-or-not generator per rank.
        return_exceptions: put what a rank's protocol raised in its result instead of raising.

    Returns:
        Every rank's result, and the statistics (`SimStats`).

    Raises:
        RuntimeError: ranks yielded different operations, or some finished before others
            (a real job would hang there).
        Exception: what the first rank (by rank) raised, unless `return_exceptions`.
    """
    # one process holds every simulated rank's objects: a collection of all of them would be
    # charged to whichever rank happened to allocate (a real rank holds only its own)
    collecting = gc.isenabled()
    gc.disable()
    n = len(protocols)
    stats = SimStats([0.0] * n)
    results: List[Any] = [None] * n
    inbox: List[Any] = [None] * n
    first = True
    try:
        while True:
            ops: List[Any] = []
            for r, proto in enumerate(protocols):
                start = time.process_time()
                try:
                    ops.append(next(proto) if first else proto.send(inbox[r]))
                except StopIteration as stop:
                    results[r] = stop.value
                    ops.append(None)
                except Exception as e:
                    if not return_exceptions:
                        raise
                    results[r] = e
                    ops.append(None)
                finally:
                    stats.cpu_s[r] += time.process_time() - start
            first = False
            finished = sum(op is None for op in ops)
            if finished == n:
                return results, stats
            if finished or len({type(op) for op in ops}) != 1:
                kinds = sorted({type(o).__name__ for o in ops})
                raise RuntimeError(f"simulated ranks diverged (a real job would hang): {kinds}")
            inbox = deliver(ops)
            got = [_received(x, n, isinstance(ops[0], AllToAll)) for x in inbox]
            nbytes = [b for b, _ in got]
            stats.exchanges.append(
                Exchange(type(ops[0]).__name__, max(nbytes), max(m for _, m in got), sum(nbytes))
            )
    finally:
        if collecting:
            gc.enable()
