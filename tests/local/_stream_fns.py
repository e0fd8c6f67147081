"""Rank functions for the streamed replication tests (module level: sent to worker ranks)."""

from __future__ import annotations

import errno
import os
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication import _stream
from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy

from ._local_fns import error_of, node_root


def _state(iteration: int) -> BasicTensorAwareStateDict:
    """Several messages per image: 1.5 MiB tensors (sent as views) between small ones (packed)."""
    g = torch.Generator().manual_seed(10 * iteration + dist.get_rank())
    big = {f"big{i}": torch.randn(3 << 17, generator=g) for i in range(4)}
    small = {f"s{i}": torch.randn(i + 3, generator=g).to(torch.bfloat16) for i in range(3)}
    return BasicTensorAwareStateDict({**big, **small, "step": iteration})


def _same(a: BasicTensorAwareStateDict, b: BasicTensorAwareStateDict) -> bool:
    return all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.tensors, b.tensors))


def round_trip(tmp: str, factor: int, is_async: bool) -> Tuple[List[str], bool, bool]:
    """Saves with a window of 2 receive buffers (re-posted receives), loads it back, then
    loads again after losing this rank's directory on rank 0.

    Returns (files here, own state loaded exactly, rank 0 recovered exactly)."""
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    _stream.WINDOW = 2
    repl = CliqueReplicationStrategy.from_replication_params(1, factor)
    m = LocalCheckpointManager(node_root(tmp), "s", repl)
    request = m.save(_state(1), 1, is_async=is_async)
    if is_async:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.close()
    files = sorted(os.listdir(m.local_ckpt_dir))
    state, _ = LocalCheckpointManager(node_root(tmp), "s", repl).load()
    loaded = _same(state, _state(1)) and state.state_dict["step"] == 1
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(m.local_ckpt_dir):
            os.remove(os.path.join(m.local_ckpt_dir, name))
    dist.barrier()
    state, _ = LocalCheckpointManager(node_root(tmp), "s", repl).load()
    return files, loaded, _same(state, _state(1))


def failing_receiver(tmp: str) -> Tuple[Tuple[str, str], List[str], bool]:
    """Iteration 1 saved; in the save of 2, rank 0's write of its peer's replica fails with
    ENOSPC after the first chunk. Returns (error, files here, iteration 1 still loads)."""
    repl = CliqueReplicationStrategy.from_replication_params(1, 2)
    m = LocalCheckpointManager(node_root(tmp), "s", repl)
    m.save(_state(1), 1)
    if dist.get_rank() == 0:
        real = m._open_image

        def opening(ckpt_id: Any, nbytes: int) -> Any:
            sink = real(ckpt_id, nbytes)
            writes = []
            write = sink.write

            def failing(data: Any, offset: int) -> None:
                writes.append(offset)
                if len(writes) > 1:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                write(data, offset)

            sink.write = failing
            return sink

        m._open_image = opening  # type: ignore[method-assign]
    err = error_of(m.save, _state(2), 2)
    files = sorted(os.listdir(m.local_ckpt_dir))
    fresh = LocalCheckpointManager(node_root(tmp), "s", repl)
    ok = fresh.find_latest() == 1 and _same(fresh.load()[0], _state(1))
    return err, files, ok
