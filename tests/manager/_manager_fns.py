"""Rank functions for the multi-rank manager tests (importable by worker ranks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
from dist_checkpointing.errors import NoUsableCheckpointError

ROWS = 2


def _state(step: int) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(rank * ROWS, (rank + 1) * ROWS, dtype=torch.float32)
    w = rows[:, None] + torch.full((ROWS, 3), float(step) * 100)
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "bias": ShardedTensor.from_rank_offsets(
            "bias", torch.full((3,), float(step)), replica_id=rank
        ),
        "step": step,
    }


_repl_cache: Dict[Tuple[int, int], Any] = {}


def _replication(world: int) -> Any:
    """Copies of each local part on another rank: cliques {0, 1} on 2 ranks, {0, 2} and
    {1, 3} on 4 (one strategy, i.e. one set of groups, per world size, reused)."""
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy

    jump = 1 if world == 2 else 2
    if (world, jump) not in _repl_cache:
        _repl_cache[(world, jump)] = CliqueReplicationStrategy.from_replication_params(
            replication_jump=jump, replication_factor=2
        )
    return _repl_cache[(world, jump)]


def _peer(rank: int, world: int) -> int:
    """The rank that holds the replica of `rank`'s local part (see `_replication`)."""
    return rank ^ 1 if world == 2 else (rank + 2) % 4


def _options(local_root: str, replicated: bool = False) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(
        save_interval=2,
        keep_last=3,
        local_root=local_root,
        local_save_interval=1,
        replication=_replication(dist.get_world_size()) if replicated else None,
    )


def _flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))


def _damage(root: Path, local_root: Path, kind: str) -> None:
    rank = dist.get_rank()
    mine = local_root / "dist_ckpt" / str(rank)
    if kind in ("local_lost", "persistent_incomplete") and rank == 1:
        for p in mine.iterdir():
            p.unlink()
    if kind == "local_damaged" and rank == 1:
        part = next(p for p in mine.iterdir() if p.name.endswith("_local.pt"))  # not a spare
        _flip(part, part.stat().st_size // 2)
    if kind == "persistent_incomplete" and rank == 0:
        (root / "iter_0000006" / "metadata.json").unlink()
    if kind == "persistent_damaged_on_one_rank":
        for p in mine.iterdir():
            p.unlink()  # no local tier anywhere
        if rank == 1:  # the rows rank 1 loads are stored in its own data file
            from dist_checkpointing.tools._storage import read_dcp_metadata, stored_items

            ckpt = root / "iter_0000006"
            item = next(
                i
                for i in stored_items(read_dcp_metadata(ckpt))
                if i.key == "w" and i.offsets[0] == ROWS
            )
            _flip(ckpt / item.file, item.offset + item.length - 8)


def _part(local_root: Path, holder: int, owner: int) -> Path:
    """The local part of step 7 owned by `owner` in `holder`'s directory."""
    return local_root / "dist_ckpt" / str(holder) / f"iter_0000007_{owner}_local.pt"


def _damage_replicated(root: Path, local_root: Path, kind: str) -> None:
    """Damage with replication on: rank 1 and the peer holding its replica."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = _peer(1, world)
    lost = {"repl_local_lost": {1}}.get(kind, {1, peer} if "clique_lost" in kind else set())
    if rank in lost:  # the node's disk is gone: its own part and the replicas it held
        for p in (local_root / "dist_ckpt" / str(rank)).iterdir():
            p.unlink()
    if kind == "repl_local_damaged" and rank == 1:
        part = _part(local_root, 1, 1)
        _flip(part, part.stat().st_size // 2)
    if "clique_damaged" in kind and rank in (1, peer):  # rank 1's part and its replica
        part = _part(local_root, rank, 1)
        _flip(part, part.stat().st_size // 2)
    if kind.endswith("persistent_incomplete") and rank == 0:
        (root / "iter_0000006" / "metadata.json").unlink()


def train_damage_and_resume(
    base: str, kind: str, replicated: bool = False
) -> Tuple[int, str, bool, int]:
    """Saves steps 1..7 (persistent 2, 4, 6; local 7), damages per `kind`, loads anew.

    Returns `(step, tier, values_ok, skipped)` as seen by this rank.
    """
    root, local_root = Path(base) / "p", Path(base) / "l"
    manager = CheckpointManager(root, _options(str(local_root), replicated))
    for step in range(1, 8):
        manager.save(step, _state(step))
    manager.close()
    dist.barrier()
    if replicated:
        rank, world = dist.get_rank(), dist.get_world_size()
        held = sorted(
            p.name
            for p in (local_root / "dist_ckpt" / str(rank)).iterdir()
            if not p.name.startswith("spare_")  # superseded parts kept for the next save
        )
        owners = sorted({rank, _peer(rank, world)})
        assert held == [f"iter_0000007_{o}_local.pt" for o in owners], held
        _damage_replicated(root, local_root, kind)
    else:
        _damage(root, local_root, kind)
    dist.barrier()
    manager = CheckpointManager(root, _options(str(local_root), replicated))
    request = _state(0)
    for v in request.values():
        if isinstance(v, ShardedTensor):
            v.data.zero_()
    state, step = manager.load(request)
    want = _state(step)
    ok = torch.equal(state["w"], want["w"].data) and torch.equal(state["bias"], want["bias"].data)
    info = manager.last_restore
    manager.close()
    assert info is not None
    return step, info.tier, bool(ok and state["step"] == step), len(info.skipped)


def nothing_usable(base: str) -> str:
    """Every candidate damaged: the error every rank gets."""
    root, local_root = Path(base) / "p", Path(base) / "l"
    manager = CheckpointManager(root, _options(str(local_root)))
    for step in range(1, 3):
        manager.save(step, _state(step))
    manager.close()
    dist.barrier()
    if dist.get_rank() == 0:
        for p in (root / "iter_0000002").glob("*.distcp"):
            os.truncate(p, 10)
    part = next((local_root / "dist_ckpt" / str(dist.get_rank())).glob("iter_*_local.pt"))
    _flip(part, 64)
    dist.barrier()
    manager = CheckpointManager(root, _options(str(local_root)))
    try:
        manager.load(_state(0))
    except NoUsableCheckpointError as e:
        return str(e)
    finally:
        manager.close()
    return "loaded"


def save_other_steps(base: str) -> Tuple[str, list]:
    """Rank r saves step 10 + r through a manager (every step due); returns the error's
    message and what is left in the persistent tier."""
    opts = CheckpointManagerOptions(save_interval=1, async_save=False)
    manager = CheckpointManager(os.path.join(base, "persistent"), opts)
    step = 10 + dist.get_rank()
    try:
        manager.save(step, _state(step))
        message = ""
    except Exception as e:
        message = f"{type(e).__name__}: {e}"
    manager.close()
    dist.barrier()
    return message, sorted(os.listdir(os.path.join(base, "persistent")))
