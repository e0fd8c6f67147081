"""AsyncRequest's supported changes (prepend, futures) and the queue's single-rank use."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import List

import pytest

from dist_checkpointing.async_save import AsyncCallsQueue, AsyncRequest, CallState
from dist_checkpointing.errors import AsyncSaveError, CheckpointingException


def record(log: List[str], name: str) -> str:
    log.append(name)
    return name


def test_prepend_async_fn_runs_prepended_work_first_and_keeps_the_result():
    log: List[str] = []
    req = AsyncRequest(record, (log, "write"), [])
    req.prepend_async_fn(record, log, "common-2")
    req.prepend_async_fn(record, log, "common-1")
    assert req.execute_sync() == "write"
    assert log == ["common-1", "common-2", "write"]


def test_prepend_async_fn_on_empty_request_runs_the_work():
    log: List[str] = []
    req = AsyncRequest(None, (), [])
    req.prepend_async_fn(record, log, "only")
    assert req.execute_sync() == "only" and log == ["only"]


def test_frozen_request_refuses_changes():
    req = AsyncRequest(record, ([], "x"), []).freeze()
    with pytest.raises(CheckpointingException, match="frozen"):
        req.prepend_async_fn(record, [], "y")
    with pytest.raises(CheckpointingException, match="frozen"):
        req.add_finalize_fn(lambda: None)


def test_future_request_refuses_prepend_and_async_fn():
    future: concurrent.futures.Future = concurrent.futures.Future()
    req = AsyncRequest.from_future(future, [], description="f")
    with pytest.raises(CheckpointingException, match="wraps a future"):
        req.prepend_async_fn(record, [], "y")
    with pytest.raises(CheckpointingException, match="both a future and an async_fn"):
        AsyncRequest(record, ([], "x"), [], future=future)


def test_queue_finalizes_future_request_only_after_the_future_is_done():
    future: concurrent.futures.Future = concurrent.futures.Future()
    finalized: List[object] = []
    req = AsyncRequest.from_future(future, [lambda: finalized.append(req.result)])
    q = AsyncCallsQueue()
    q.schedule_async_request(req)
    assert q.maybe_finalize_async_calls(no_dist=True) == [] and finalized == []
    threading.Timer(0.1, future.set_result, (7,)).start()
    assert q.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert finalized == [7] and q.get_num_unfinalized_calls() == 0
    q.close()


def test_queue_raises_async_save_error_when_future_fails():
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(OSError("disk gone"))
    cleaned: List[bool] = []
    req = AsyncRequest.from_future(future, [], cleanup_fns=[lambda: cleaned.append(True)])
    q = AsyncCallsQueue()
    q.schedule_async_request(req)
    with pytest.raises(AsyncSaveError, match="disk gone"):
        q.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert cleaned == [True] and q.get_num_unfinalized_calls() == 0
    q.close()


def test_call_states_are_an_enum():
    assert {s.value for s in CallState} == {"running", "ok", "failed"}
