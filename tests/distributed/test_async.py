"""Async save: round trips, ordering, faults on one rank, equivalence with sync writes."""

from __future__ import annotations

import filecmp
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import AsyncSaveError, CheckpointingException
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

pytestmark = pytest.mark.timeout(180)


def state(step: int = 0) -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    full = torch.randn(16, 8 * w, generator=g)
    return {
        "w": ShardedTensor.from_rank_offsets("w", full[:, r * 8 : (r + 1) * 8].clone(), (1, r, w)),
        "b": ShardedTensor.from_rank_offsets(
            "b", torch.arange(5, dtype=torch.int64) + step, replica_id=r
        ),
        "o": ShardedObject("rng", {"rank": r, "step": step}, (w,), (r,)),
        "step": step,
    }


def check(ckpt: str, step: int) -> bool:
    want = state(step)
    req = state(step)
    req["w"].data.zero_()
    got = dc.load(req, ckpt)
    return (
        torch.equal(got["w"], want["w"].data)
        and torch.equal(got["b"], want["b"].data)
        and got["o"] == want["o"].data
        and got["step"] == step
    )


def slow_writer(delay: float, fn: Any, *args: Any) -> Any:
    time.sleep(delay)
    return fn(*args)


def failing_writer(*args: Any) -> Any:
    raise OSError(28, "No space left on device (injected)")


def killed_writer(*args: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def _queue(persistent: bool) -> AsyncCallsQueue:
    return AsyncCallsQueue(persistent=persistent)


def round_trip(root: str, persistent: bool) -> List[bool]:
    q = _queue(persistent)
    ckpt = os.path.join(root, "c")
    sd = state(3)
    sd["history"] = [1, 2]
    req = dc.save(sd, ckpt, async_sharded_save=True)
    assert isinstance(req, AsyncRequest)
    for t in sd.values():  # the caller may change its tensors as soon as save() returns
        if isinstance(t, ShardedTensor):
            t.data.fill_(-1)
    sd["history"].append(3)  # ... and its common state
    committed_early = dc.check_is_distributed_checkpoint(ckpt)
    if dist.get_rank() == 0:  # common.pt comes from rank 0's writer, not yet scheduled here
        committed_early |= os.path.exists(os.path.join(ckpt, "common.pt"))
    q.schedule_async_request(req)
    done = q.maybe_finalize_async_calls(blocking=True)
    q.close()
    return [
        not committed_early,
        done == [0],
        dc.check_is_distributed_checkpoint(ckpt),
        check(ckpt, 3),
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_async_round_trip_holds_state_at_save_time(world_factory, tmp_path, world_size, persistent):
    results = world_factory(world_size).run_ok(round_trip, str(tmp_path), persistent)
    assert results == [[True, True, True, True]] * world_size


def out_of_order(root: str, persistent: bool) -> Dict[str, Any]:
    q = _queue(persistent)
    ckpt = os.path.join(root, "c")
    req = dc.save(state(1), ckpt, async_sharded_save=True)
    if dist.get_rank() == 1:
        req.async_fn, req.async_fn_args = slow_writer, (1.5, req.async_fn, *req.async_fn_args)
    q.schedule_async_request(req)
    polls, committed_while_pending = 0, False
    while True:
        done = q.maybe_finalize_async_calls(blocking=False)
        if done:
            break
        polls += 1
        committed_while_pending |= dc.check_is_distributed_checkpoint(ckpt)
        time.sleep(0.05)
    q.close()
    return {"polls": polls, "early": committed_while_pending, "ok": check(ckpt, 1)}


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_call_is_finalized_only_when_every_rank_finished(world_factory, tmp_path, persistent):
    results = world_factory(2).run_ok(out_of_order, str(tmp_path), persistent)
    assert results[0] == results[1]
    assert results[0]["polls"] >= 5 and not results[0]["early"] and results[0]["ok"]


def several_outstanding(root: str, persistent: bool) -> List[Any]:
    q = _queue(persistent)
    for step in (10, 20, 30):
        q.schedule_async_request(
            dc.save(state(step), os.path.join(root, f"iter_{step}"), async_sharded_save=True)
        )
    assert q.get_num_unfinalized_calls() == 3
    done = q.maybe_finalize_async_calls(blocking=True)
    q.close()
    return [done] + [check(os.path.join(root, f"iter_{s}"), s) for s in (10, 20, 30)]


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_several_outstanding_requests_finalize_in_order(world_factory, tmp_path, persistent):
    assert (
        world_factory(2).run_ok(several_outstanding, str(tmp_path), persistent)
        == [[[0, 1, 2], True, True, True]] * 2
    )


def fault_then_recover(root: str, persistent: bool, fault: str) -> Dict[str, Any]:
    q = _queue(persistent)
    dc.save(state(1), os.path.join(root, "good"))  # an earlier checkpoint must stay intact
    bad = os.path.join(root, "bad")
    req = dc.save(state(2), bad, async_sharded_save=True)
    if dist.get_rank() == 1:
        req.async_fn = {"raise": failing_writer, "kill": killed_writer}[fault]
    q.schedule_async_request(req)
    error = ""
    try:
        q.maybe_finalize_async_calls(blocking=True)
    except AsyncSaveError as e:
        error = str(e)
    out = {
        "error": error,
        "bad_committed": dc.check_is_distributed_checkpoint(bad),
        "unfinalized": q.get_num_unfinalized_calls(),
        "good_ok": check(os.path.join(root, "good"), 1),
    }
    q.schedule_async_request(dc.save(state(3), os.path.join(root, "next"), async_sharded_save=True))
    out["next_done"] = q.maybe_finalize_async_calls(blocking=True)
    out["next_ok"] = check(os.path.join(root, "next"), 3)
    q.close()
    return out


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
@pytest.mark.parametrize(
    "fault,message", [("raise", "No space left on device"), ("kill", "exit code -9")]
)
def test_writer_failure_raises_on_every_rank_and_queue_recovers(
    world_factory, tmp_path, persistent, fault, message
):
    results = world_factory(2).run_ok(fault_then_recover, str(tmp_path), persistent, fault)
    for res in results:
        assert "rank 1" in res["error"] and message in res["error"], res["error"]
        assert not res["bad_committed"] and res["unfinalized"] == 0 and res["good_ok"]
        assert res["next_done"] == [1] and res["next_ok"]


def three_ways(root: str) -> None:
    dc.save(state(5), os.path.join(root, "sync"))
    dc.save(state(5), os.path.join(root, "exec_sync"), async_sharded_save=True).execute_sync()
    q = _queue(False)
    q.schedule_async_request(
        dc.save(state(5), os.path.join(root, "queued"), async_sharded_save=True)
    )
    q.close()


def test_sync_execute_sync_and_async_write_identical_bytes(world_factory, tmp_path):
    world_factory(2).run_ok(three_ways, str(tmp_path))
    ref = tmp_path / "sync"
    names = sorted(p.name for p in ref.iterdir())
    for other in ("exec_sync", "queued"):
        assert sorted(p.name for p in (tmp_path / other).iterdir()) == names
        for name in names:
            if name.endswith(".distcp") or name in ("common.pt", "metadata.json"):
                assert filecmp.cmp(ref / name, tmp_path / other / name, shallow=False), (
                    other,
                    name,
                )
        with open(ref / ".metadata", "rb") as a, open(tmp_path / other / ".metadata", "rb") as b:
            ma, mb = pickle.load(a), pickle.load(b)
        assert (
            ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
        )


def repeated_saves(root: str) -> List[int]:
    q = _queue(True)
    pool = get_default_save_sharded_strategy()._images
    sizes = []
    for step in range(5):
        q.schedule_async_request(
            dc.save(state(step), os.path.join(root, f"s{step}"), async_sharded_save=True)
        )
        q.maybe_finalize_async_calls(blocking=True)
        sizes.append(pool.allocated_bytes)
    q.close()
    return sizes


def test_host_buffers_are_reused_across_saves(world_factory, tmp_path):
    for sizes in world_factory(2).run_ok(repeated_saves, str(tmp_path)):
        assert sizes[0] > 0 and len(set(sizes)) == 1, sizes


def test_async_save_with_non_async_strategy_is_refused(tmp_path):
    from dist_checkpointing.strategies.base import SaveShardedStrategy

    class SyncOnly(SaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            pass

    with pytest.raises(CheckpointingException, match="does not support async save"):
        dc.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(1))},
            tmp_path / "c",
            sharded_strategy=SyncOnly("x", 1),
            async_sharded_save=True,
        )


def half_async(root: str) -> Any:
    """Rank 1 saves async, rank 0 sync: refused on both, before anything is written."""
    ckpt = os.path.join(root, "c")
    q = _queue(False)
    message = None
    try:
        request = dc.save(state(1), ckpt, async_sharded_save=dist.get_rank() == 1)
        if request is not None:
            q.schedule_async_request(request)
            q.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as e:
        message = str(e)
    finally:
        q.close()
    # each rank removes what it created before raising; rank 0 may still be at it when
    # rank 1 has raised, so the directory is looked at once every rank has returned
    dist.barrier()
    return message, os.path.exists(ckpt)


def test_ranks_saving_sync_and_async_at_once_raise_at_once_naming_each(world_factory, tmp_path):
    """Before, the async rank and the sync rank waited in different collectives until the
    timeout; now the save's first agreement compares how every rank saves."""
    start = time.monotonic()
    results = world_factory(2).run_ok(half_async, str(tmp_path), timeout=30)
    assert time.monotonic() - start < 20
    for message, written in results:
        assert message is not None, "a rank saved without error"
        assert "rank 1:" in message and ", async" in message and "rank 0:" in message, message
        assert "async_sharded_save" in message and not written


def test_exit_with_unfinalized_calls_warns(tmp_path):
    script = textwrap.dedent(
        f"""
        import logging, torch, dist_checkpointing as dc
        from dist_checkpointing import ShardedTensor
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        logging.basicConfig(level=logging.WARNING)
        q = AsyncCallsQueue()
        q.schedule_async_request(dc.save({{"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}}, {str(tmp_path / "c")!r}, async_sharded_save=True))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "unfinalized async checkpoint save" in out.stderr
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")
