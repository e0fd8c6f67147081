"""Rank functions for the parity replication tests (module level: sent to worker ranks).

Every rank is one "node" with its own root `<tmp>/node<rank>` (replication_jump=1).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing.local import _parity_math
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import ParityReplicationStrategy

from ._local_fns import error_of, node_root

_strategies: Dict[int, ParityReplicationStrategy] = {}
#: small messages, so that parts of a few hundred KiB span several chunks
CHUNK = 64 << 10
#: tensors of 16 KiB or more are sent from their own memory (smaller ones copied together)
SMALL = 16 << 10


def strategy(k: int) -> ParityReplicationStrategy:
    """One strategy (process groups) per group size and world, reused across tests."""
    _parity_math.PARITY_CHUNK = CHUNK
    _parity_math.SMALL_MESSAGE = SMALL
    if k not in _strategies:
        _strategies[k] = ParityReplicationStrategy.from_replication_params(1, k)
    return _strategies[k]


def state(iteration: int) -> BasicTensorAwareStateDict:
    """Unequal parts: rank r's tensors grow with r (padding within a group is exercised)."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(100 * iteration + r)
    return BasicTensorAwareStateDict(
        {
            "w": torch.randn(20_000 + 7_777 * r, generator=g),
            "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "meta": {"rank": r, "it": iteration},
        }
    )


def _same(a: BasicTensorAwareStateDict, b: BasicTensorAwareStateDict) -> bool:
    return a.state_dict["meta"] == b.state_dict["meta"] and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.tensors, b.tensors)
    )


def _manager(tmp: str, k: int) -> LocalCheckpointManager:
    return LocalCheckpointManager(node_root(tmp), "s", strategy(k))


def _node_dir(tmp: str) -> str:
    return os.path.join(node_root(tmp), "s", str(dist.get_rank()))


def _restore(tmp: str) -> None:
    """Every rank puts its node's files back from the backup taken after the save."""
    dist.barrier()
    shutil.rmtree(_node_dir(tmp), ignore_errors=True)
    shutil.copytree(_node_dir(tmp) + ".bak", _node_dir(tmp))
    dist.barrier()


def _lose(tmp: str, nodes: List[int]) -> None:
    dist.barrier()
    if dist.get_rank() in nodes:
        shutil.rmtree(_node_dir(tmp))
    dist.barrier()


def save_then_lose_each_node(tmp: str, k: int, is_async: bool) -> Dict[str, Any]:
    """Saves iteration 1 and 2 (2 replaces 1); then for each node: loses its files, loads.

    Returns this rank's files after the save, its bytes kept / own part, and per lost node
    (iteration loaded, state bit-exact)."""
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    m = _manager(tmp, k)
    for it in (1, 2):
        request = m.save(state(it), it, is_async=is_async)
        if is_async:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            queue.close()
    # superseded files are kept as spares for the next save to write over (docs/local.md)
    files = sorted(f for f in os.listdir(_node_dir(tmp)) if not f.startswith("spare_"))
    sizes = {f: os.path.getsize(os.path.join(_node_dir(tmp), f)) for f in files}
    shutil.copytree(_node_dir(tmp), _node_dir(tmp) + ".bak")
    results = []
    for node in range(dist.get_world_size()):
        _lose(tmp, [node])
        loaded, ckpt_id = _manager(tmp, k).load()
        results.append((ckpt_id[0], _same(loaded, state(2))))
        _restore(tmp)
    return {"files": files, "sizes": sizes, "results": results}


def lose_nodes(tmp: str, k: int, nodes: List[int]) -> Tuple[int, Any]:
    """Loses `nodes` (from the backup's state): (find_latest, load outcome: bit-exact or error)."""
    _lose(tmp, nodes)
    m = _manager(tmp, k)
    latest = m.find_latest()
    err = error_of(m.load)
    outcome: Any = err
    if not err[0]:
        outcome = _same(_manager(tmp, k).load()[0], state(2))
    _restore(tmp)
    return latest, outcome


def flip_parity_then_lose(tmp: str, k: int, holder: int, lost: int) -> Tuple[Any, Any]:
    """Flips a byte of `holder`'s parity segment: a plain load still works; with node `lost`
    gone too, the load fails. Returns (plain load bit-exact, error after the loss)."""
    dist.barrier()
    if dist.get_rank() == holder:
        name = next(f for f in os.listdir(_node_dir(tmp)) if f.endswith("_parity.bin"))
        with open(os.path.join(_node_dir(tmp), name), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    plain = _same(_manager(tmp, k).load()[0], state(2))
    _lose(tmp, [lost])
    err = error_of(_manager(tmp, k).load)
    _restore(tmp)
    return plain, err


def parity_params_error(jump: Any, k: Any) -> Tuple[str, str]:
    return error_of(ParityReplicationStrategy.from_replication_params, jump, k)


def manager_resume(base: str, k: int, lost: List[int]) -> Tuple[int, str, bool, int]:
    """A CheckpointManager (persistent every 2 steps, local tier with parity every step)
    saves steps 1..3; `lost` nodes lose their local files; a new manager loads.

    Returns `(step, tier, values bit-exact, candidates skipped)` as seen by this rank."""
    from pathlib import Path

    from dist_checkpointing import CheckpointManager, CheckpointManagerOptions
    from tests.manager._manager_fns import _state

    root, local_root = Path(base) / "p", Path(base) / "l"
    options = CheckpointManagerOptions(
        save_interval=2,
        keep_last=2,
        local_root=str(local_root),
        local_save_interval=1,
        replication=strategy(k),
    )
    manager = CheckpointManager(root, options)
    for step in range(1, 4):
        manager.save(step, _state(step))
    manager.close()
    dist.barrier()
    if dist.get_rank() in lost:
        shutil.rmtree(local_root / "dist_ckpt" / str(dist.get_rank()))
    dist.barrier()
    manager = CheckpointManager(root, options)
    request = _state(0)
    state, step = manager.load(request)
    want = _state(step)
    ok = torch.equal(state["w"], want["w"].data) and torch.equal(state["bias"], want["bias"].data)
    info = manager.last_restore
    manager.close()
    assert info is not None
    return step, info.tier, bool(ok and state["step"] == step), len(info.skipped)


def local_backend_round_trip(tmp: str, k: int) -> Tuple[bool, bool]:
    """`dc.save` through the ('local', 2) backend with parity; loads it intact, then after
    node 0 lost its parts and parity (its part rebuilt). Returns (intact ok, rebuilt ok)."""
    import dist_checkpointing as dc
    from dist_checkpointing.strategies.local import LocalSaveShardedStrategy

    from ._local_fns import dc_load, local_dir, sharded_state

    strategy_ = LocalSaveShardedStrategy(repl_strategy=strategy(k))
    dc.save(sharded_state(), local_dir(tmp), sharded_strategy=strategy_)
    intact = dc_load(tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(local_dir(tmp), "0"))
    dist.barrier()
    return intact, dc_load(tmp)
