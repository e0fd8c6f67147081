"""Names under a checkpoint manager's root: step directories and the `latest` record.

`<root>/iter_<step, 7+ digits>/` holds one persistent checkpoint (Megatron-LM's naming);
`<root>/latest_checkpointed_iteration.txt` holds the step of the newest committed one, as
plain text, like Megatron-LM's tracker file, so scripts that know that layout keep working.
The record is replaced atomically, and only after the checkpoint it names is committed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..errors import CheckpointingException
from ..storage.fileio import atomic_write, read_capped
from .options import PathArg

__all__ = ["LATEST_FNAME", "step_dir_name", "parse_step", "read_latest", "write_latest"]

LATEST_FNAME = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"iter_(\d{7,})")


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
