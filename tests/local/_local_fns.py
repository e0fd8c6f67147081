"""Rank functions for the local checkpoint tests (module level: sent to worker ranks by reference).

Every rank gets its own root, `<tmp>/node<rank>`, to model node-local disks.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
)
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.local import LocalSaveShardedStrategy

_repl_cache: Dict[Tuple[int, int], CliqueReplicationStrategy] = {}


def repl(jump: int, factor: int) -> Optional[CliqueReplicationStrategy]:
    """One strategy (process groups) per parameter pair and world, reused across tests."""
    if factor <= 1:
        return None
    key = (jump, factor)
    if key not in _repl_cache:
        # jump 2 goes through the lazy variant (groups built on first save)
        _repl_cache[key] = (
            LazyCliqueReplicationStrategy(jump, factor)
            if jump == 2
            else CliqueReplicationStrategy.from_replication_params(jump, factor)
        )
    return _repl_cache[key]


def node_root(tmp: str, rank: Optional[int] = None) -> str:
    return os.path.join(tmp, f"node{dist.get_rank() if rank is None else rank}")


def make_state(iteration: int) -> BasicTensorAwareStateDict:
    r = dist.get_rank()
    g = torch.Generator().manual_seed(1000 * iteration + r)
    return BasicTensorAwareStateDict(
        {
            "model": {
                "w": torch.randn(64, 33, generator=g),
                "b": torch.arange(7, dtype=torch.int64) + r,
            },
            "opt": [torch.randn(5, generator=g).to(torch.bfloat16), {"step": iteration}],
            "flags": torch.tensor([True, False]),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "meta": {"rank": r, "name": "run"},
        }
    )


def same_state(a: BasicTensorAwareStateDict, b: BasicTensorAwareStateDict) -> bool:
    ta, tb = a.tensors, b.tensors
    return (
        len(ta) == len(tb)
        and all(
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb)
        )
        and a.state_dict["meta"] == b.state_dict["meta"]
        and a.state_dict["opt"][1] == b.state_dict["opt"][1]
    )


def manager(tmp: str, jump: int = 1, factor: int = 1) -> LocalCheckpointManager:
    return LocalCheckpointManager(node_root(tmp), "sess", repl(jump, factor))


def save_iterations(
    tmp: str, iterations: List[int], jump: int, factor: int, is_async: bool
) -> List[str]:
    m = manager(tmp, jump, factor)
    queue = AsyncCallsQueue() if is_async else None
    for it in iterations:
        state = make_state(it)
        req = m.save(state, it, is_async=is_async)
        if queue is not None:
            assert req is not None
            # the caller may change its tensors as soon as save returns
            queue.schedule_async_request(req)
            for t in state.tensors:
                if t.numel():
                    t.view(-1)[0] = 0 if t.dtype == torch.bool else 99
        assert not state.is_hollow
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    return sorted(os.listdir(m.local_ckpt_dir))


def load_latest(tmp: str, jump: int, factor: int) -> Tuple[int, bool, Any]:
    m = manager(tmp, jump, factor)
    it = m.find_latest()
    state, ckpt_id = m.load()
    return it, same_state(state, make_state(it)), ckpt_id


def find_latest(tmp: str, jump: int, factor: int) -> int:
    return manager(tmp, jump, factor).find_latest()


def remove_dirs(tmp: str, ranks: List[int]) -> None:
    dist.barrier()
    if dist.get_rank() in ranks:
        shutil.rmtree(node_root(tmp), ignore_errors=True)
    dist.barrier()


def remove_files(tmp: str, owner: int, holders: List[int]) -> None:
    """Removes `owner`'s part from the directories of `holders`."""
    dist.barrier()
    if dist.get_rank() in holders:
        for name in os.listdir(manager(tmp).local_ckpt_dir):
            if f"_{owner}_local" in name:
                os.remove(os.path.join(manager(tmp).local_ckpt_dir, name))
    dist.barrier()


def flip_byte(tmp: str, rank: int, owner: int, offset: int) -> None:
    dist.barrier()
    if dist.get_rank() == rank:
        d = manager(tmp).local_ckpt_dir
        name = [n for n in os.listdir(d) if f"_{owner}_local.pt" in n][0]
        with open(os.path.join(d, name), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()


def plant_files(tmp: str, name: str, content: bytes) -> None:
    d = manager(tmp).local_ckpt_dir
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(content)


def error_of(fn: Any, *args: Any) -> Tuple[str, str]:
    """(class name, message) of what `fn` raised, or ('', '')."""
    try:
        fn(*args)
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


def failing_save(
    tmp: str, fail_rank: int, is_async: bool
) -> Tuple[Tuple[str, str], List[str], bool]:
    """Saves 1, then a save of 2 that fails on `fail_rank` with ENOSPC; checks 1 still loads."""
    m = manager(tmp)
    m.save(make_state(1), 1)
    if dist.get_rank() == fail_rank:
        orig = m._save_image

        def broken(image: Any, ckpt_id: Any) -> None:
            path = m._path(ckpt_id, dirty=True)
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        m._save_image = broken  # type: ignore[method-assign]
    if is_async:
        queue = AsyncCallsQueue()
        req = m.save(make_state(2), 2, is_async=True)
        queue.schedule_async_request(req)
        err = error_of(queue.maybe_finalize_async_calls, True)
        queue.close()
    else:
        err = error_of(m.save, make_state(2), 2)
    if dist.get_rank() == fail_rank:
        m._save_image = orig  # type: ignore[method-assign]
    files = sorted(os.listdir(m.local_ckpt_dir))
    fresh = manager(tmp)
    ok = fresh.find_latest() == 1 and same_state(fresh.load()[0], make_state(1))
    return err, files, ok


def half_async_save(tmp: str) -> Tuple[Tuple[str, str], List[str], bool]:
    """Saves 1, then 2 with rank 1 async and rank 0 sync; then 2 again alike, and loads it.
    Returns (the error of the mixed save, the files left after it, whether 2 loaded)."""
    m = manager(tmp)
    m.save(make_state(1), 1)
    queue = AsyncCallsQueue()

    def mixed() -> None:
        req = m.save(make_state(2), 2, is_async=dist.get_rank() == 1)
        if req is not None:
            queue.schedule_async_request(req)
            queue.maybe_finalize_async_calls(blocking=True)

    err = error_of(mixed)
    queue.close()
    files = sorted(os.listdir(m.local_ckpt_dir))
    m.save(make_state(2), 2)
    fresh = manager(tmp)
    ok = fresh.find_latest() == 2 and same_state(fresh.load()[0], make_state(2))
    return err, files, ok


def planted_pickle_load(tmp: str, payload: bytes) -> Tuple[str, str]:
    m = manager(tmp)
    m.save(make_state(1), 1)
    path = m._path((1, dist.get_rank(), "sess"))
    path.write_bytes(payload)
    return error_of(lambda: manager(tmp).load())


# ---- the local backend through dc.save / dc.load ----------------------------------


def sharded_state(fill: bool = True, axis: int = 1) -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(8 * w, 8 * w, generator=g)
    local = full[:, r * 8 : (r + 1) * 8] if axis == 1 else full[r * 8 : (r + 1) * 8]
    local = local.clone() if fill else torch.zeros_like(local)
    return {
        "w": ShardedTensor.from_rank_offsets("w", local, (axis, r, w)),
        "bias": ShardedTensor.from_rank_offsets(
            "bias", (torch.arange(4.0) if fill else torch.zeros(4)), replica_id=r
        ),
        "rng": ShardedObject("rng", {"rank": r} if fill else None, (w,), (r,)),
        "iteration": 17,
    }


def local_dir(tmp: str) -> str:
    return os.path.join(node_root(tmp), "ckpt")


def dc_save(tmp: str, jump: int, factor: int, is_async: bool) -> List[str]:
    strategy = LocalSaveShardedStrategy("local", 2, repl(jump, factor))
    ckpt = local_dir(tmp)
    if is_async:
        queue = AsyncCallsQueue()
        req = dc.save(sharded_state(), ckpt, sharded_strategy=strategy, async_sharded_save=True)
        queue.schedule_async_request(req)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    else:
        dc.save(sharded_state(), ckpt, sharded_strategy=strategy)
    return sorted(os.listdir(ckpt))


def dc_load(tmp: str) -> bool:
    """Whether every loaded value matches what was saved."""
    want = sharded_state()
    got = dc.load(sharded_state(fill=False), local_dir(tmp))
    return (
        torch.equal(got["w"], want["w"].data)
        and torch.equal(got["bias"], want["bias"].data)
        and got["rng"] == want["rng"].data
        and got["iteration"] == 17
    )


def is_checkpoint(tmp: str) -> bool:
    return dc.check_is_distributed_checkpoint(local_dir(tmp))


def dc_load_other_layout(tmp: str) -> Tuple[str, str]:
    return error_of(dc.load, sharded_state(fill=False, axis=0), local_dir(tmp))


def dc_load_error(tmp: str) -> Tuple[str, str]:
    return error_of(dc.load, sharded_state(fill=False), local_dir(tmp))


def plant_on_rank(tmp: str, rank: int, name: str, content: bytes) -> None:
    if dist.get_rank() == rank:
        plant_files(tmp, name, content)


def load_after_losing_both_copies(tmp: str) -> None:
    """find_latest sees iteration 3 complete; then rank 1's part vanishes from both holders."""
    m = manager(tmp, 1, 2)
    assert m.find_latest() == 3
    dist.barrier()
    for name in os.listdir(m.local_ckpt_dir):
        if "_1_local" in name:
            os.remove(os.path.join(m.local_ckpt_dir, name))
    dist.barrier()
    m.load()


def load_v1_fixture(tmp: str) -> bool:
    """Loads the committed version-1 checkpoint (copied under `tmp`); whether it matches."""
    src = os.path.join(os.path.dirname(__file__), "data", "local_v1", f"node{dist.get_rank()}")
    shutil.copytree(src, node_root(tmp))
    dist.barrier()
    assert dc.load_tensors_metadata(local_dir(tmp))["w"].global_shape == (16, 16)
    return dc_load(tmp)


def dc_save_fully_parallel(tmp: str, factor: int) -> Dict[str, int]:
    """('local', 2) with algo='fully_parallel': the replicated 'bias' is stored by one rank.

    Returns the stored bytes per key of this rank's part."""
    strategy = LocalSaveShardedStrategy("local", 2, repl(1, factor), algo="fully_parallel")
    dc.save(sharded_state(), local_dir(tmp), sharded_strategy=strategy)
    from dist_checkpointing.local._image import decode_image, read_image

    m = LocalCheckpointManager(local_dir(tmp), "")
    path = str(m._path((0, dist.get_rank(), "")))
    _, state = decode_image(read_image(path), path)
    return {
        sh.key: sh.data.numel()
        for sh in state.sharded_state_dict.values()
        if isinstance(sh, ShardedTensor) and sh.data is not None
    }


def dc_load_in_place(tmp: str) -> bool:
    """Whether a load fills the request's own tensors (and returns them)."""
    request = sharded_state(fill=False)
    given = request["w"].data
    got = dc.load(request, local_dir(tmp))
    return got["w"] is given and torch.equal(given, sharded_state()["w"].data)
