"""Retention: which persistent checkpoints to delete. Pure functions, no I/O."""

from __future__ import annotations

from typing import Iterable, List, Optional

__all__ = ["steps_to_delete"]


def steps_to_delete(
    complete: Iterable[int],
    incomplete: Iterable[int],
    newest_committed: int,
    keep_last: int,
    keep_period: Optional[int] = None,
) -> List[int]:
    """The steps (ascending) whose directories go once `newest_committed` is committed.

    Kept: the `keep_last` newest complete steps up to `newest_committed` (at least that
    one), every multiple of `keep_period`, and every newer step (another save's business).
    Deleted: other complete steps, and incomplete ones older than `newest_committed`
    (crashed or failed saves: finalization is in order, so none of them still runs).
    """
    older = sorted(s for s in complete if s <= newest_committed)
    kept = set(older[-max(1, keep_last) :])
    kept.add(newest_committed)
    doomed = [s for s in older if s not in kept and not (keep_period and s % keep_period == 0)]
    doomed += [s for s in incomplete if s < newest_committed]
    return sorted(set(doomed))
