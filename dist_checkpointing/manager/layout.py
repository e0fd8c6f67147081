"""The checkpoint manager's options and retention (pure), what its `load` reports, and the
names under its root.

`<root>/iter_<step, 7+ digits>/` holds one persistent checkpoint (Megatron-LM's naming);
`<root>/latest_checkpointed_iteration.txt` holds the step of the newest committed one, as
plain text, like Megatron-LM's tracker file, so scripts that know that layout keep working.
The record is replaced atomically, and only after the checkpoint it names is committed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Optional, Tuple, Union

from ..errors import CheckpointingException
from ..storage.fileio import atomic_write, read_capped

__all__ = [
    "CheckpointManagerOptions",
    "RestoreInfo",
    "steps_to_delete",
    "LATEST_FNAME",
    "step_dir_name",
    "parse_step",
    "read_latest",
    "write_latest",
]

PathArg = Union[str, "os.PathLike[str]"]
_ON_ERROR = ("raise", "continue")
LATEST_FNAME = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"iter_(\d{7,})")


@dataclass
class CheckpointManagerOptions:
    """What the manager saves, when, and how many it keeps.

    Attributes:
        save_interval: a persistent checkpoint every this many steps (step % N == 0).
        keep_last: persistent checkpoints kept (the newest K complete ones; >= 1).
        keep_period: also keep every step divisible by this for ever (None: off).
        async_save: saves run in the background (finalized by later calls).
        local_root: node-local directory of the local tier (None: no local tier).
        local_save_interval: a local checkpoint every this many steps (needs `local_root`).
        replication: a `ReplicationStrategy` for the local tier (None: no copies).
        session_id: names this job's local checkpoints under `local_root`.
        on_error: 'raise': a failed save raises on every rank; 'continue': it is logged and
            recorded in `failed_saves`, and training goes on.
        sharded_strategy: persistent backend, as for `dist_checkpointing.save`.

    Raises:
        CheckpointingException: an invalid value.
    """

    save_interval: int = 1000
    keep_last: int = 2
    keep_period: Optional[int] = None
    async_save: bool = True
    local_root: Optional[PathArg] = None
    local_save_interval: Optional[int] = None
    replication: Any = None
    session_id: str = "dist_ckpt"
    on_error: str = "raise"
    sharded_strategy: Any = None

    def __post_init__(self) -> None:
        for name in ("save_interval", "keep_last", "keep_period", "local_save_interval"):
            value, optional = getattr(self, name), name in ("keep_period", "local_save_interval")
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = "None or an int" if optional else "an int"
                raise CheckpointingException(f"{name} must be {what} >= 1, got {value!r}")
        if self.on_error not in _ON_ERROR:
            raise CheckpointingException(
                f"on_error must be one of {_ON_ERROR}, got {self.on_error!r}"
            )
        if (self.local_root is None) != (self.local_save_interval is None):
            raise CheckpointingException(
                "local_root and local_save_interval go together (both set for a local tier)"
            )


@dataclass
class RestoreInfo:
    """What the last `load` did: the step and tier loaded, and each skipped candidate."""

    step: int
    tier: str
    path: str
    skipped: List[Tuple[str, str]] = field(default_factory=list)


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


def step_dir_name(step: int) -> str:
    """`iter_<step, zero-padded to 7 digits>`."""
    return f"iter_{step:07d}"


def parse_step(name: str) -> Optional[int]:
    """The step of a directory named `iter_NNNNNNN`, or None for any other name."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def read_latest(root: PathArg) -> Optional[int]:
    """The step in `<root>/latest_checkpointed_iteration.txt`, or None (missing, unreadable)."""
    try:
        raw = read_capped(Path(root) / LATEST_FNAME, 64)
        step = -1 if raw is None else int(raw.decode("ascii").strip())
    except (CheckpointingException, ValueError):  # unreadable, oversized or not a number
        return None
    return step if step >= 0 else None


def write_latest(root: PathArg, step: int) -> None:
    """Atomically records `step` as the newest committed checkpoint (temp file, fsync, rename)."""
    payload = f"{step}\n".encode()
    atomic_write(Path(root) / LATEST_FNAME, lambda f: f.write(payload))
