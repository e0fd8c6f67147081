"""`list_checkpoints`: every checkpoint-like directory under a root, complete or not. Torch-free
unless a committed checkpoint is one the light reader does not know (another backend, damage).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from . import _info
from ._info import CheckpointInfo, PathArg
from ._light import _STEP_DIR, Unsupported, describe_light
from ._local_info import local_tier

__all__ = ["list_checkpoints"]

_MAX_DEPTH = 4  # <root>/<run>/local/<session>: deep enough for a manager's two tiers
_LATEST = "latest_checkpointed_iteration.txt"  # manager.layout.LATEST_FNAME (imports torch)


def list_checkpoints(root: PathArg) -> List[CheckpointInfo]:
    """Every checkpoint-like directory at or under `root` (up to 4 levels down), newest first
    (by step, then date), with its `state`: committed (any backend, stock DCP), incomplete (no
    commit record), unusable (damaged commit record), and each step of a manager's local tier;
    `latest=True` for the one its `latest` record names. Not collective; reads metadata only.

    Raises:
        NotACheckpointError: `root` does not exist or is not a directory.
    """
    base = Path(root)
    _info.check_dir(base)
    found: List[CheckpointInfo] = []
    _visit(base, 0, found)
    found.sort(key=lambda i: (i.step if i.step is not None else -1, i.date), reverse=True)
    return found


def _visit(path: Path, depth: int, found: List[CheckpointInfo]) -> None:
    tier = local_tier(path) if not _info.exists(path / "metadata.json") else {}
    if tier:
        found.extend(tier.values())
    elif _info.has_checkpoint_files(path) or _STEP_DIR.fullmatch(path.name):
        info = _describe(path)
        info.latest = info.step is not None and info.step == _latest(path.parent)
        found.append(info)
    elif depth < _MAX_DEPTH:
        for sub in (path / n for n in _info.names(path)):
            if _is_dir(sub):
                _visit(sub, depth + 1, found)


def _describe(ckpt: Path) -> CheckpointInfo:
    try:
        return describe_light(ckpt, deep=False)
    except Unsupported:
        pass
    if not _info.exists(ckpt / "metadata.json") and not _info.is_stock_dcp(ckpt):
        m = _STEP_DIR.fullmatch(ckpt.name)
        return _info.incomplete(ckpt, int(m.group(1)) if m else None)
    from .inspect import describe  # torch: damaged, or a backend the light reader does not know

    return describe(ckpt, deep=False)


def _is_dir(path: Path) -> bool:
    fs = _info._remote(path)
    return bool(fs.is_dir(path)) if fs is not None else path.is_dir() and not path.is_symlink()


def _latest(root: Path) -> Optional[int]:
    fs = _info._remote(root)
    try:
        if fs is not None:
            return int((fs.read_object(root / _LATEST, 64) or b"").decode("ascii").strip())
        with open(root / _LATEST, "rb") as f:
            return int(f.read(64).decode("ascii").strip())
    except (OSError, ValueError):  # none, unreadable or not a number
        return None
