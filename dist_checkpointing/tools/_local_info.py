"""What `describe` reports of local checkpoints (the local manager's `<rank>/iter_*` parts
and parity records), for both of its readers; torch-free, as `_info` (parts are read only
through the `rank_state` callback of `fill_local`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..errors import NotACheckpointError
from ._info import CheckpointInfo, ChecksumCoverage, TensorInfo, date_of, short_repr

__all__ = [
    "LocalPart",
    "local_parts",
    "local_tier",
    "local_parity",
    "parity_status",
    "tier_step",
    "fill_local",
]

_LOCAL_PART = re.compile(r"iter_(\d{7,})_(\d+)_local(\.dirty)?\.pt")
_LOCAL_PARITY = re.compile(r"iter_(\d{7,})_(\d+)_parity\.bin")  # committed parity records


@dataclass(frozen=True)
class LocalPart:
    """One part of a local checkpoint, as found on this machine (`dirty`: not committed)."""

    holder: int
    owner: int
    iteration: int
    path: Path
    dirty: bool = False


def local_parts(
    ckpt: Path, iteration: Optional[int] = None, dirty: bool = False
) -> List[LocalPart]:
    """Committed (with `dirty`, also uncommitted) parts under `<ckpt>/<rank>/` [of `iteration`]."""
    out = []
    for sub in sorted(ckpt.iterdir()) if ckpt.is_dir() else []:
        for f in sorted(sub.iterdir()) if sub.is_dir() and sub.name.isdigit() else []:
            m = _LOCAL_PART.fullmatch(f.name)
            if m and (dirty or not m[3]) and iteration in (None, int(m[1])):
                out.append(LocalPart(int(sub.name), int(m[2]), int(m[1]), f, bool(m[3])))
    return out


def local_parity(ckpt: Path, iteration: Optional[int] = None) -> List[LocalPart]:
    """Committed parity records under `<ckpt>/<rank>/` [of `iteration`] (`owner`: the holder)."""
    out = []
    for sub in sorted(ckpt.iterdir()) if ckpt.is_dir() else []:
        for f in sorted(sub.iterdir()) if sub.is_dir() and sub.name.isdigit() else []:
            m = _LOCAL_PARITY.fullmatch(f.name)
            if m and iteration in (None, int(m[1])):
                out.append(LocalPart(int(sub.name), int(m[2]), int(m[1]), f))
    return out


def parity_status(
    ckpt: Path, iteration: int, present: Set[int], world: int
) -> Tuple[str, Set[int], int]:
    """`(summary, rebuildable owners, world size)` of `iteration` from the parity records on
    this machine (their headers only); `("", set(), world)` without any."""
    from ..local._parity_math import plan_rebuild, read_record_info

    records: Dict[int, List[Any]] = {}
    groups, unreadable = set(), []
    for f in local_parity(ckpt, iteration):
        try:
            rec = read_record_info(str(f.path))
            if (rec.iteration, rec.holder) != (iteration, f.owner) or f.holder != f.owner:
                raise ValueError("misplaced")
        except (OSError, ValueError):
            unreadable.append(f.owner)
            continue
        records.setdefault(rec.holder, []).append(rec.info())
        groups.add(tuple(rec.group))
    if not records and not unreadable:
        return "", set(), world
    world = max([world, *(r + 1 for g in groups for r in g)])
    lost = set(range(world)) - present
    plan, _ = plan_rebuild(iteration, lost, present, [records.get(r, []) for r in range(world)])
    text = (
        f"parity groups {sorted(list(g) for g in groups)}: parts present {sorted(present)}, "
        f"rebuildable {sorted(plan)}, lost {sorted(lost - set(plan))}"
    )
    if unreadable:
        text += f"; unreadable parity records of rank(s) {sorted(unreadable)}"
    return text, set(plan), world


def local_tier(ckpt: Path) -> Dict[int, CheckpointInfo]:
    """`{step: entry}` of a manager's local tier (`<rank>/iter_<step>_<owner>_local.pt`), from
    file names; else empty. A step is complete when this machine holds a committed part of
    every rank seen in the tier (on several nodes, each sees its own ranks' parts), or can
    rebuild the missing ones from the parity records here (their headers are read)."""
    parts = local_parts(ckpt, dirty=True)
    world = max((p.owner for p in parts), default=-1) + 1
    out: Dict[int, CheckpointInfo] = {}
    for it in sorted({p.iteration for p in parts}):
        mine = [p for p in parts if p.iteration == it]
        done = {p.owner for p in mine if not p.dirty}
        text, rebuildable, world_it = parity_status(ckpt, it, done, world)
        dirty = sorted({p.owner for p in mine} - done)
        missing = sorted(set(range(world_it)) - done - rebuildable)
        size = sum(p.path.stat().st_size for p in mine + local_parity(ckpt, it))
        info = out[it] = CheckpointInfo(str(ckpt), "local", True, it, "local tier", size, "")
        info.date, info.world_size, info.parity = max(date_of(p.path) for p in mine), world_it, text
        if missing:
            info.kind, info.complete = "incomplete", False
            info.problem = f"no committed part of rank(s) {missing} here" + (
                " (.dirty: a save that did not finish, or is still running)" if dirty else ""
            )
    return out


def tier_step(ckpt: Path, tier: Dict[int, CheckpointInfo], step: Optional[int]) -> CheckpointInfo:
    """`step`'s entry of a local tier (default: the newest complete one, else the newest)."""
    if step is None:
        step = max((s for s, i in tier.items() if i.complete), default=max(tier))
    if step not in tier:
        raise NotACheckpointError(f"{ckpt}: no step {step} in this local tier (has {sorted(tier)})")
    return tier[step]


def fill_local(
    info: CheckpointInfo,
    parts: List[LocalPart],
    rank_state: Callable[[LocalPart], Dict[str, Any]],
    deep: bool,
) -> None:
    """Fills `info` from a local checkpoint's parts (for both readers); reads none unless `deep`.

    `rank_state` reads one part into `world_size` (or None), `common`, `objects` and
    `sharded`: `"<key> (<offset>)"` -> `(global shape, dtype name, item size)`.
    """
    if not parts:
        raise NotACheckpointError(f"{info.path}: a local checkpoint without any part")
    owners = sorted({p.owner for p in parts})
    info.checksums = ChecksumCoverage(present=True, items=len(owners), items_covered=len(owners))
    text, _, world = parity_status(Path(info.path), parts[0].iteration, set(owners), owners[-1] + 1)
    info.parity = info.parity or text
    if not deep:
        info.world_size = max(world, len(owners))
        return
    tensors: Dict[str, TensorInfo] = {}
    for owner in owners:
        mine = [p for p in parts if p.owner == owner]
        sd = rank_state(min(mine, key=lambda p: p.holder != owner))  # its own copy, else a replica
        info.world_size = sd.get("world_size") or max(world, len(owners))
        cls = sd.get("state_class")
        if cls:  # a user's TensorAwareStateDict: no global layout stored
            info.backend = f"{info.backend or 'local'} of {cls}"
            info.note = (
                f"a {cls} per rank (shapes are each rank's own); LocalCheckpointManager.load "
                "restores it"
            )
        for slot, (global_shape, dtype, itemsize) in sd["sharded"].items():
            key = slot.rsplit(" (", 1)[0]
            shape = [int(s) for s in global_shape]
            nbytes = math.prod(shape) * itemsize
            tensors.setdefault(key, TensorInfo(key, shape, dtype, nbytes, 0)).shards += 1
        for key, value in (sd.get("objects") or {}).items():
            info.objects[key] = short_repr(value)
        if owner == owners[0]:
            for key, value in (sd.get("common") or {}).items():
                info.objects[str(key)] = short_repr(value)
    info.tensors = [tensors[k] for k in sorted(tensors)]
