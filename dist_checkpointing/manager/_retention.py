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
    """The steps whose directories go once `newest_committed` is committed.

    Kept: the `keep_last` newest complete steps up to `newest_committed` (never fewer than
    one: the newest committed is always kept), every step that is a multiple of
    `keep_period`, and everything newer than `newest_committed` (another save's business).
    Deleted: older complete steps beyond those, and incomplete steps older than
    `newest_committed` (saves that crashed or failed; in-order finalization means none of
    them is still running).

    Args:
        complete: steps with a committed checkpoint.
        incomplete: steps with a directory but no commit record.
        newest_committed: the step just committed.
        keep_last: how many complete checkpoints to keep (>= 1).
        keep_period: keep every step divisible by it for ever (None: no such rule).

    Returns:
        Steps to delete, ascending.
    """
    older = sorted(s for s in complete if s <= newest_committed)
    kept = set(older[-max(1, keep_last) :])
    kept.add(newest_committed)
    doomed = [s for s in older if s not in kept and not (keep_period and s % keep_period == 0)]
    doomed += [s for s in incomplete if s < newest_committed]
    return sorted(set(doomed))
